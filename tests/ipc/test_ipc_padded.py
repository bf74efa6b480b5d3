"""Padded slot requests (what a GPU parent writes from the device: ids and weights [T, K],
-1 for no expert) through a real arena to a real daemon process that computes on the host:
the daemon serves them as the equivalent ragged requests. And the ATTACH refusals of the
device-direct transport where it cannot work. Shape legend: T tokens, H hidden, K slots."""
from __future__ import annotations

import time

import numpy as np
import pytest

from moerun.engine.runtime import Runtime
from moerun.ipc import shm
from moerun.ipc.client import DaemonClient, DaemonError
from moerun.ipc.shm import Arena, ArenaLayout
from moerun.rig.links import RigError
from moerun.rig.settings import RigConfig
from tests.support.daemon_fixtures import tiny_daemon_model
from tests.support.fake_daemon import (
    FINGERPRINT,
    HIDDEN,
    daemon_process,
    expected_output,
    ramp,
)

TOP_K = 4
LOCAL_EXPERTS = {1: [5, 2, 7]}


@pytest.fixture
def client():
    with daemon_process("--capacity", "64") as daemon:
        client = DaemonClient(daemon.endpoint, connect_timeout_s=10)
        client.hello(FINGERPRINT)
        client.assign(LOCAL_EXPERTS)
        yield client
        client.close()


def write_padded(client: DaemonClient, slot: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                 dtype: str = "f32") -> None:
    """What the parent's pack kernel does, from the host: frames straight into the slot."""
    frames = client.arena.slots[slot]
    frames.write_x(dtype, x)
    frames._local_ids[:ids.size] = ids.reshape(-1)
    frames._weights[:weights.size] = weights.reshape(-1)


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_a_padded_request_equals_its_ragged_form(client, tokens):
    client.attach_shared(batch_capacity=64, hidden=HIDDEN, max_pairs_per_token=TOP_K)
    rng = np.random.default_rng(tokens)
    x = ramp(tokens, seed=tokens)
    ids = np.where(rng.random((tokens, TOP_K)) < 0.5, rng.integers(0, 3, (tokens, TOP_K)), -1).astype(np.int32)
    ids[0] = -1                                                   # a token with nothing here
    weights = rng.random((tokens, TOP_K)).astype(np.float32)
    write_padded(client, 2, x, ids, weights)
    request = client.post(2, 1, "f32", tokens)
    client.collect(request, timeout_s=10)
    present = ids >= 0
    want = expected_output(1, x, present.sum(axis=1), ids[present], weights[present])
    np.testing.assert_allclose(client.arena.slots[2].read_result(tokens), want, rtol=1e-6)
    assert client.slot_idle(2)


def test_a_padded_request_with_a_bad_local_id_is_an_error_reply(client):
    client.attach_shared(batch_capacity=8, hidden=HIDDEN, max_pairs_per_token=TOP_K)
    ids = np.full((2, TOP_K), -1, np.int32)
    ids[1, 0] = 3                                                 # the daemon holds 3 experts of layer 1
    write_padded(client, 0, ramp(2), ids, np.ones((2, TOP_K), np.float32))
    request = client.post(0, 1, "f32", 2)
    with pytest.raises(DaemonError, match="local expert id"):
        client.collect(request, timeout_s=10)
    assert client.slot_idle(0)                                    # and the slot is free again


def test_a_cpu_daemon_refuses_the_device_transport(client):
    with pytest.raises(DaemonError, match="device transport needs a GPU daemon"):
        client.attach_shared(batch_capacity=8, hidden=HIDDEN, max_pairs_per_token=TOP_K, transport="device",
                             incoming=[bytes(64)] * 4)
    assert client.arena is None


def test_a_padded_request_must_carry_t_times_k_pairs(client):
    from moerun.ipc import shm
    from moerun.ipc.protocol import ProtocolError
    layout = ArenaLayout(1, 8, HIDDEN, TOP_K)
    buffer = bytearray(8192)
    shm.write_request_header(buffer, 9, 1, "f32", 3, 5, HIDDEN, padded=True)
    with pytest.raises(ProtocolError, match="tokens \\* 4 pairs"):
        shm.read_request_header(buffer, layout)
    shm.write_request_header(buffer, 9, 1, "f16", 3, 12, HIDDEN, padded=True)
    assert shm.read_request_header(buffer, layout) == (1, "f16", 3, 12, True)


def test_device_transport_needs_a_gpu_parent(tmp_path):
    rig = RigConfig(daemons=("cpu",), transport="device", daemon_timeout_s=30)
    with pytest.raises(RigError, match="--transport device needs both on GPUs of one vendor"):
        Runtime(tiny_daemon_model(tmp_path), rig=rig)


def test_a_daemon_table_names_its_own_transport(tmp_path):
    """[[daemon]] transport = "stream" beside the rig's shared one: each link gets its own."""
    from moerun.rig.settings import DaemonEntry
    entries = (DaemonEntry(name="a", device="cpu", transport="stream"), DaemonEntry(name="b", device="cpu"))
    rig = RigConfig(daemons=("cpu", "cpu"), daemon_entries=entries, transport="shared", hot=1, daemon_timeout_s=30)
    with Runtime(tiny_daemon_model(tmp_path), rig=rig) as runtime:
        assert [link.transport for link in runtime.rig.links] == ["stream", "shared"]


def ring_like_a_gpu(slot, request_id: int, layer: int, tokens: int) -> None:
    """What ring_slot does from the device: the header and the sequence word, no doorbell."""
    shm.write_request_header(slot.buffer, request_id, layer, "f32", tokens, tokens * TOP_K, HIDDEN, padded=True)
    slot.request_seq = slot.request_seq + 1


def test_a_request_rung_without_the_doorbell_is_served(client):
    """A GPU parent's kernels write the request and its sequence word but cannot ring the
    doorbell: the daemon finds the slot (spinning, or once rouse() rang for it), and answers
    the device's request id (bit 63 set) with a RESULT."""
    client.attach_shared(batch_capacity=8, hidden=HIDDEN, max_pairs_per_token=TOP_K)
    arena = client.arena
    ids = np.array([[0, 2, -1, -1], [1, -1, -1, -1]], np.int32)
    weights = np.full((2, TOP_K), 0.5, np.float32)
    x = ramp(2, seed=3)
    want = expected_output(1, x, (ids >= 0).sum(axis=1), ids[ids >= 0], weights[ids >= 0])
    for n, request_id in enumerate([(1 << 63) | 1, (1 << 63) | 2]):
        write_padded(client, n, x, ids, weights)
        ring_like_a_gpu(arena.slots[n], request_id, 1, 2)
        deadline = time.monotonic() + 10
        while arena.slots[n].pending() and time.monotonic() < deadline:
            arena.rouse()
            time.sleep(0.001)
        assert not arena.slots[n].pending()
        assert shm.read_reply_header(arena.slots[n].buffer)[:3] == (request_id, 2, HIDDEN)
        np.testing.assert_allclose(arena.slots[n].read_result(2), want, rtol=1e-6)


def test_rouse_rings_only_for_a_sleeping_daemon_with_work():
    layout = ArenaLayout(slots=2, batch_capacity=4, hidden=HIDDEN, max_pairs_per_token=TOP_K)
    arena = Arena.create(layout)
    try:
        bell = arena.doorbell.value()
        arena.slots[1].request_seq = 1                                # a pending request
        arena.rouse()
        assert arena.doorbell.value() == bell                         # the daemon is awake
        arena.words[shm.DAEMON_SLEEPING_WORD] = 1
        arena.rouse()
        assert arena.doorbell.value() == bell + 1
        arena.slots[1].request_seq = 0                                # answered: nothing to wake it for
        arena.rouse()
        assert arena.doorbell.value() == bell + 1
    finally:
        arena.unlink()
        arena.close()


def test_a_spinning_wait_ends_when_work_is_ready():
    layout = ArenaLayout(slots=1, batch_capacity=4, hidden=HIDDEN, max_pairs_per_token=TOP_K)
    arena = Arena.create(layout)
    try:
        calls = iter(range(1000))
        started = time.monotonic()
        assert arena.doorbell.wait(arena.doorbell.value(), spin_s=30, sleep_s=0, ready=lambda: next(calls) >= 3)
        assert time.monotonic() - started < 10
        assert not arena.doorbell.wait(arena.doorbell.value(), spin_s=0.01, sleep_s=0, ready=lambda: False)
    finally:
        arena.unlink()
        arena.close()
