"""COMPUTE round trips through real daemon processes: stream over ipc:// and tcp://, and the
shared arena; every payload dtype, ragged routing, many requests in flight, batch sizes up to
the capacity. Shape legend: T tokens, H hidden size, P routed pairs."""
from __future__ import annotations

import contextlib
import os

import ml_dtypes
import numpy as np
import pytest

from moerun.ipc import protocol as p
from moerun.ipc.client import DaemonClient, DaemonError
from tests.support.fake_daemon import (
    FINGERPRINT,
    HIDDEN,
    daemon_process,
    expected_output,
    ramp,
    routing,
)
from tests.support.live_processes import tcp_endpoint
from tests.support.shm_segments import shm_segments

CAPACITY = 512
LOCAL_EXPERTS = {0: [3, 1, 4, 5], 2: [9, 2, 6, 8, 7, 0]}   # layer -> global ids (local order)
TRANSPORTS = ("stream-ipc", "stream-tcp", "shared")
ROUNDING = {"f32": lambda x: x,
            "f16": lambda x: x.astype(np.float16).astype(np.float32),
            "bf16": lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)}


@pytest.fixture(scope="module")
def daemons():
    with contextlib.ExitStack() as stack:
        yield {
            "stream-ipc": stack.enter_context(daemon_process("--capacity", str(CAPACITY))),
            "stream-tcp": stack.enter_context(daemon_process("--capacity", str(CAPACITY),
                                                             endpoint=tcp_endpoint())),
            "shared": stack.enter_context(daemon_process("--capacity", str(CAPACITY))),
        }


@pytest.fixture(params=TRANSPORTS)
def client(request, daemons):
    transport = request.param
    client = DaemonClient(daemons[transport].endpoint, connect_timeout_s=10)
    client.hello(FINGERPRINT)
    progress = []
    client.assign(LOCAL_EXPERTS, progress=lambda done, total: progress.append((done, total)))
    assert progress == [(1, 2), (2, 2)]
    if transport == "shared":
        assert client.same_host()
        client.attach_shared(batch_capacity=CAPACITY, hidden=HIDDEN, max_pairs_per_token=4)
    assert client.transport == ("shared" if transport == "shared" else "stream")
    yield client
    client.bye()
    client.close()
    assert shm_segments() == set()


def round_trip(client, layer, x, counts, local_ids, weights, dtype="f32"):
    return client.wait(client.submit(layer, x, counts, local_ids, weights, dtype), timeout_s=10)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_payload_dtypes(client, dtype):
    x = ramp(37)
    counts, local_ids, weights = routing(37, n_local=6, max_k=4, seed=1)
    out = round_trip(client, 2, x, counts, local_ids, weights, dtype)
    assert out.dtype == np.float32 and out.shape == x.shape
    # The daemon computes on exactly the rounded payload; f32 is bit-exact.
    np.testing.assert_array_equal(out, expected_output(2, ROUNDING[dtype](x), counts, local_ids,
                                                       weights))
    reference = expected_output(2, x, counts, local_ids, weights)
    tolerance = {"f32": 0, "f16": 2**-10, "bf16": 2**-7}[dtype]
    np.testing.assert_allclose(out, reference, rtol=tolerance, atol=tolerance)


def test_ragged_routing_with_idle_tokens(client):
    x = ramp(6)
    counts = np.array([0, 2, 0, 0, 4, 1], np.int32)
    local_ids = np.array([1, 3, 0, 1, 2, 3, 2], np.int32)
    weights = np.linspace(0.1, 0.7, 7).astype(np.float32)
    out = round_trip(client, 0, x, counts, local_ids, weights)
    np.testing.assert_array_equal(out, expected_output(0, x, counts, local_ids, weights))
    assert not out[[0, 2, 3]].any()
    none = np.zeros(0, np.int32)
    out = round_trip(client, 0, x, np.zeros(6, np.int32), none, none.view(np.float32))
    assert not out.any()


@pytest.mark.parametrize("tokens", [1, 2, 7, 100, CAPACITY])
def test_batch_sizes_up_to_capacity(client, tokens):
    x = ramp(tokens, seed=tokens)
    counts, local_ids, weights = routing(tokens, n_local=4, max_k=4, seed=tokens)
    out = round_trip(client, 0, x, counts, local_ids, weights)
    np.testing.assert_array_equal(out, expected_output(0, x, counts, local_ids, weights))


def test_more_requests_in_flight_than_slots(client):
    requests = []
    for i in range(11):
        x = ramp(1 + 9 * i, seed=i)
        routed = routing(len(x), n_local=6, max_k=3, seed=i)
        requests.append((client.submit(2, x, *routed, "f32"), x, routed))
    for request_id, x, routed in reversed(requests):
        np.testing.assert_array_equal(client.wait(request_id, timeout_s=10),
                                      expected_output(2, x, *routed))
    assert client.counters.calls == 11


def test_counters_and_stats(client):
    x = ramp(4)
    routed = routing(4, n_local=4, max_k=2)
    round_trip(client, 0, x, *routed)
    counters = client.counters
    assert counters.calls == 1 and counters.bytes_sent > x.nbytes
    assert counters.bytes_received >= x.nbytes and counters.compute_seconds > 0
    assert counters.wait_seconds > 0
    stats = client.stats()
    assert stats["computes"] >= 1 and stats["layers"] == 2
    assert stats["server"]["parent"]["pid"] == os.getpid()
    assert stats["server"]["transport"] == client.transport
    assert 0 < client.ping() < 1


def test_bad_requests_get_errors_and_the_daemon_keeps_serving(client):
    x = ramp(3)
    counts = np.array([1, 1, 1], np.int32)
    weights = np.ones(3, np.float32)
    with pytest.raises(DaemonError) as error:   # local id 4 does not exist in layer 0
        round_trip(client, 0, x, counts, np.array([0, 4, 1], np.int32), weights)
    assert error.value.code == p.BAD_REQUEST and "IndexError" in error.value.message
    with pytest.raises(DaemonError) as error:   # layer 1 has no experts here
        round_trip(client, 1, x, counts, np.zeros(3, np.int32), weights)
    assert error.value.code == p.BAD_REQUEST and "KeyError" in error.value.message
    routed = (counts, np.array([0, 1, 2], np.int32), weights)
    np.testing.assert_array_equal(round_trip(client, 0, x, *routed), expected_output(0, x, *routed))


def test_over_capacity(client):
    x = ramp(CAPACITY + 1)
    routed = routing(CAPACITY + 1, n_local=4, max_k=1)
    if client.transport == "shared":
        with pytest.raises(ValueError, match="batch capacity"):
            client.submit(0, x, *routed, "f32")
    else:
        with pytest.raises(DaemonError) as error:
            round_trip(client, 0, x, *routed)
        assert error.value.code == p.BAD_REQUEST and "tokens" in error.value.message


def test_compute_before_assign_is_not_ready(daemons):
    with DaemonClient(daemons["stream-ipc"].endpoint) as client:
        client.hello(FINGERPRINT)
        with pytest.raises(DaemonError) as error:
            round_trip(client, 0, ramp(1), *routing(1, n_local=4, max_k=1))
        assert error.value.code == p.NOT_READY
        client.bye()
