"""Garbage against a live daemon: random, truncated, oversized, wrong-version, wrong-op,
wrong-dtype, wrong-shape and wrong-frame-count messages from a raw DEALER socket, and garbage
written into an attached arena's slots. Every message gets a reply (or, past the frame size
limit, the connection is dropped); the daemon stays up and still answers correctly."""
from __future__ import annotations

import contextlib
import time

import msgpack
import numpy as np
import pytest
import zmq

from moerun.ipc import protocol as p
from moerun.ipc import shm
from moerun.ipc.client import DaemonClient
from moerun.ipc.shm import REQUEST_HEADER_OFFSET
from tests.support.fake_daemon import (
    FINGERPRINT,
    HIDDEN,
    daemon_process,
    expected_output,
    ramp,
    routing,
)
from tests.support.shm_segments import shm_segments

CAPACITY = 8
REPLY_WITHIN_S = 30.0    # for an answer that must come; a loaded 2-core machine can be slow
ERROR_CODES = {p.BAD_FRAME, p.VERSION_MISMATCH, p.FINGERPRINT_MISMATCH, p.BUSY, p.NO_SESSION,
               p.BAD_REQUEST, p.NOT_READY, p.INTERNAL}


def valid_compute(rng, request_id):
    tokens = int(rng.integers(1, CAPACITY + 1))
    counts, local_ids, weights = routing(tokens, n_local=4, max_k=3, seed=request_id)
    header = {"v": 1, "op": "compute", "id": request_id, "layer": 0, "dtype": "f32",
              "tokens": tokens, "pairs": len(local_ids), "hidden": HIDDEN}
    return header, [ramp(tokens).tobytes(), counts.tobytes(), local_ids.tobytes(),
                    weights.tobytes()]


def garbage_message(rng, request_id) -> list[bytes]:
    """One malformed message: a header frame and data frames."""
    header, frames = valid_compute(rng, request_id)
    kind = int(rng.integers(16))
    def random_bytes(n) -> bytes:
        return rng.integers(0, 256, int(n), dtype=np.uint8).tobytes()
    if kind == 0:
        return [random_bytes(rng.integers(0, 300))] + frames[:int(rng.integers(0, 5))]
    if kind == 1:
        packed = msgpack.packb(header)
        return [packed[:int(rng.integers(0, len(packed)))]] + frames
    if kind == 2:
        return [msgpack.packb({**header, "pad": "x" * (p.MAX_HEADER_BYTES + 10)})] + frames
    if kind == 3:
        header["v"] = [0, 2, 99, "1", None, 1.0, -1][int(rng.integers(7))]
    elif kind == 4:
        header["op"] = ["result", "pong", "progress", "error", "ready", "", "COMPUTE", 7, None,
                        "x" * 100][int(rng.integers(10))]
    elif kind == 5:
        header["dtype"] = ["f64", "F32", "", None, 3, "int8"][int(rng.integers(6))]
    elif kind == 6:
        key = ["tokens", "pairs", "hidden", "layer"][int(rng.integers(4))]
        header[key] = [0, -1, 10**12, 2**63 - 1, "3", 1.5, None, [1], True][int(rng.integers(9))]
    elif kind == 7:
        frames = frames[:int(rng.integers(0, 4))] if rng.random() < 0.5 else frames + [b"x"]
    elif kind == 8:
        index = int(rng.integers(4))
        frames[index] = frames[index][:max(0, len(frames[index]) - int(rng.integers(1, 9)))]
    elif kind == 9:
        header["id"] = ["7", None, 1.5, [1], -(2**63)][int(rng.integers(5))]
    elif kind == 10:
        return [msgpack.packb([header])] + frames
    elif kind == 11:
        header = {"v": 1, "op": "assign", "id": request_id, "experts": [
            None, {"0": [1, 1]}, {"x": [1]}, {"0": [-1]}, {"0": "abc"}, {"99": [1]},
            {"0": [99]}, {"0": [[1], [1]]}, {"²": [1]}, {"0": [True]}][int(rng.integers(10))]}
        return [msgpack.packb(header)]
    elif kind == 12:
        header = {"v": 1, "op": "attach", "id": request_id, "name": [
            "moerun-1-0123456789abcdef", "../../etc/passwd", None, 5][int(rng.integers(4))],
            "layout": 1, "slots": int(rng.integers(-1, 100)), "size": int(rng.integers(0, 2**40)),
            "batch_capacity": int(rng.integers(-5, 10**6)), "hidden": HIDDEN,
            "max_pairs_per_token": 2}
        return [msgpack.packb(header)]
    elif kind == 13:
        counts = np.frombuffer(frames[1], np.int32).copy()
        counts[0] -= int(rng.integers(1, 3))
        frames[1] = counts.tobytes()
    elif kind == 14:
        local_ids = np.frombuffer(frames[2], np.int32).copy()
        if local_ids.size:
            local_ids[-1] = [4, 1000, -1, 2**31 - 1][int(rng.integers(4))]
        frames[2] = local_ids.tobytes()
    else:
        header = {"v": 1, "op": "hello", "id": request_id, "fingerprint": [
            "other", None, 5][int(rng.integers(3))], "parent": [None, {"pid": "x"}, {}][
            int(rng.integers(3))]}
        return [msgpack.packb(header)]
    return [msgpack.packb(header, use_bin_type=True)] + frames


@contextlib.contextmanager
def raw_dealer(endpoint: str):
    """A DEALER of the test's own, connected to `endpoint`; closed with linger 0 on every path."""
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        yield dealer
    finally:
        context.destroy(linger=0)


def receive(dealer, timeout_s=REPLY_WITHIN_S):
    """The next message as (header, data frames), or None when none came within timeout_s."""
    if not dealer.poll(int(timeout_s * 1000)):
        return None
    reply = dealer.recv_multipart()
    return msgpack.unpackb(reply[0]), reply[1:]


def exchange(dealer, parts, timeout_s=REPLY_WITHIN_S):
    dealer.send_multipart(parts)
    return receive(dealer, timeout_s)


@pytest.fixture
def daemon():
    with daemon_process("--capacity", str(CAPACITY)) as daemon:
        yield daemon
        assert daemon.alive()
        assert "internal error" not in daemon.log()
    assert shm_segments() == set()


def test_garbage_messages_from_a_raw_socket(daemon):
    with raw_dealer(daemon.endpoint) as dealer:
        hello = {"v": 1, "op": "hello", "id": 1, "fingerprint": FINGERPRINT,
                 "parent": p.host_identity()}
        reply = exchange(dealer, [msgpack.packb(hello)])
        assert reply is not None and reply[0]["op"] == "hello", reply
        assign = {"v": 1, "op": "assign", "id": 2, "experts": {"0": [5, 6, 7, 8]}}
        dealer.send(msgpack.packb(assign))
        while (reply := receive(dealer)) is not None and reply[0]["op"] != "ready":
            pass
        assert reply is not None, "no READY after ASSIGN"

        rng = np.random.default_rng(1234)
        codes = {}
        for request_id in range(100, 1300):
            reply = exchange(dealer, garbage_message(rng, request_id))
            assert reply is not None, f"no reply to garbage message {request_id}"
            header, _ = reply
            assert header["v"] == 1 and header["op"] in ("error", "result", "hello", "ready")
            if header["op"] == "error":
                assert header["code"] in ERROR_CODES and isinstance(header["message"], str)
                assert header["id"] in (request_id, None)
                codes[header["code"]] = codes.get(header["code"], 0) + 1
        assert {p.BAD_FRAME, p.BAD_REQUEST, p.VERSION_MISMATCH} <= set(codes)

        header, frames = valid_compute(rng, 5000)
        reply_header, (out,) = exchange(dealer, [msgpack.packb(header)] + frames)
        assert reply_header["op"] == "result"
        x, counts, local_ids, weights = (np.frombuffer(f, t) for f, t in zip(
            frames, (np.float32, np.int32, np.int32, np.float32)))
        np.testing.assert_array_equal(
            np.frombuffer(out, np.float32).reshape(-1, HIDDEN),
            expected_output(0, x.reshape(-1, HIDDEN), counts, local_ids, weights))

        oversized = np.zeros(CAPACITY * HIDDEN + (2 << 20), np.uint8).tobytes()   # past MAXMSGSIZE
        assert exchange(dealer, [msgpack.packb(header), oversized], timeout_s=0.3) is None
    with DaemonClient(daemon.endpoint) as client:    # the session's owner is gone for good
        time.sleep(0.05)
        client.ping(timeout_s=REPLY_WITHIN_S)        # still answers: DaemonTimeout otherwise


def garbage_slot_request(rng, slot, request_id):
    """Write one malformed COMPUTE request into `slot`: random header bytes, or a valid request
    with one bad header field or bad routing."""
    tokens = int(rng.integers(1, CAPACITY + 1))
    counts, local_ids, weights = routing(tokens, n_local=4, max_k=3, seed=request_id)
    fields = {"request_id": request_id, "layer": 0, "dtype": "f32", "tokens": tokens,
              "pairs": len(local_ids), "hidden": HIDDEN}
    kind = request_id % 7
    if kind == 1:
        counts[0] += [-1, 1, -(2**31), 2**30][int(rng.integers(4))]
    elif kind == 2:
        local_ids = np.append(local_ids, [4, 1000, -1, 2**31 - 1][int(rng.integers(4))])
        weights = np.append(weights, np.float32(1)).astype(np.float32)
        counts[-1] += 1
        fields["pairs"] += 1
    slot.write_request_frames("f32", ramp(tokens), counts, local_ids, weights)
    shm.write_request_header(slot.buffer, **fields)
    values = list(shm.REQUEST.unpack_from(slot.buffer, REQUEST_HEADER_OFFSET))
    if kind == 0:
        size = shm.REQUEST.size
        slot.buffer[REQUEST_HEADER_OFFSET:REQUEST_HEADER_OFFSET + size] = (
            rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        return
    if kind == 3:   # version, op
        field = int(rng.integers(2))
        values[field] = [0, 2, 99, 2**32 - 1][int(rng.integers(4))]
    elif kind == 4:   # layer, dtype
        field, bad = [(3, -1), (3, -(2**31)), (4, 3), (4, 2**32 - 1)][int(rng.integers(4))]
        values[field] = bad
    elif kind == 5:   # tokens, pairs (at most CAPACITY * 3 here), hidden
        field = int(rng.integers(5, 8))
        bad = {5: [0, CAPACITY + 1, 2**32 - 1], 6: [3 * CAPACITY + 1, 2**32 - 1],
               7: [0, HIDDEN - 1, HIDDEN + 1, 2**32 - 1]}[field]
        values[field] = bad[int(rng.integers(len(bad)))]
    elif kind == 6:   # a field that disagrees with the frames
        values[6] += 1
    shm.REQUEST.pack_into(slot.buffer, REQUEST_HEADER_OFFSET, *values)


def test_garbage_in_arena_slots(daemon):
    with DaemonClient(daemon.endpoint, connect_timeout_s=REPLY_WITHIN_S) as client:
        garbage_into_slots_then_compute(client)


def garbage_into_slots_then_compute(client):
    client.hello(FINGERPRINT)
    client.assign({0: [1, 2, 3, 4]})
    client.attach_shared(batch_capacity=CAPACITY, hidden=HIDDEN, max_pairs_per_token=3, slots=2)
    arena = client._shared.arena
    slot = arena.slots[1]
    rng = np.random.default_rng(99)
    codes = set()
    for request_id in range(350):
        garbage_slot_request(rng, slot, request_id)
        sent_id = shm.request_id(slot.buffer)
        slot.request_seq = slot.request_seq + 1
        arena.doorbell.ring()
        deadline = time.monotonic() + REPLY_WITHIN_S
        while slot.reply.value() != slot.request_seq:
            assert time.monotonic() < deadline, f"no reply to slot garbage {request_id}"
            slot.reply.wait(slot.reply.value(), 0.001, 0.05)
        reply_id, _, _, _, error = shm.read_reply_header(slot.buffer)
        assert reply_id == sent_id and error is not None, f"garbage {request_id} was served"
        assert error[0] in ERROR_CODES and error[1]
        codes.add(error[0])
    assert codes == {p.BAD_REQUEST, p.VERSION_MISMATCH}

    x = ramp(3)
    routed = routing(3, n_local=4, max_k=3, seed=3)
    for _ in range(3):   # more than the slot count: every slot is usable again
        out = client.wait(client.submit(0, x, *routed, "f32"), timeout_s=REPLY_WITHIN_S)
        np.testing.assert_array_equal(out, expected_output(0, x, *routed))
    client.bye()
