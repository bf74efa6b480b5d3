"""Protocol encoding, COMPUTE validation, the arena layout and the futex doorbell, in-process."""
from __future__ import annotations

import os
import platform
import stat
import threading
import time

import ml_dtypes
import msgpack
import numpy as np
import pytest

from moerun.ipc import doorbell, shm
from moerun.ipc import protocol as p
from moerun.ipc.shm import (
    REQUEST_HEADER_OFFSET,
    SHM_DIR,
    Arena,
    ArenaLayout,
    sweep_stale_segments,
)
from tests.support.shm_segments import shm_segments


def compute_message(tokens=3, pairs=4, hidden=8, dtype="f32", counts=(1, 0, 3)):
    header = {"v": 1, "op": "compute", "id": 7, "layer": 2, "dtype": dtype, "tokens": tokens,
              "pairs": pairs, "hidden": hidden}
    x = p.encode_payload(np.ones((tokens, hidden), np.float32), dtype)
    frames = [x.tobytes(), np.array(counts, np.int32).tobytes(),
              np.arange(pairs, dtype=np.int32).tobytes(), np.ones(pairs, np.float32).tobytes()]
    return header, frames


def test_headers_round_trip_and_accept_numpy_scalars():
    data = p.pack_header("ping", id=np.int64(5), scale=np.float32(0.5))
    assert p.unpack_header(data) == {"v": 1, "op": "ping", "id": 5, "scale": 0.5}


@pytest.mark.parametrize("data, code", [
    (b"\xc1garbage", p.BAD_FRAME),
    (msgpack.packb([1, 2]), p.BAD_FRAME),
    (msgpack.packb({"v": 1}), p.BAD_FRAME),
    (msgpack.packb({"v": 2, "op": "ping"}), p.VERSION_MISMATCH),
    (msgpack.packb({"v": True, "op": "ping"}), p.VERSION_MISMATCH),
    (b"\x81" * (p.MAX_HEADER_BYTES + 1), p.BAD_FRAME),
])
def test_bad_headers_are_protocol_errors(data, code):
    with pytest.raises(p.ProtocolError) as error:
        p.unpack_header(data, "parent", "daemon")
    assert error.value.code == code
    if code == p.VERSION_MISMATCH:
        assert "parent speaks version" in error.value.message
        assert "daemon speaks version 1" in error.value.message


@pytest.mark.parametrize("dtype, tolerance", [("f32", 0.0), ("f16", 2**-11), ("bf16", 2**-8)])
def test_payload_encodings(dtype, tolerance):
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    wire = p.encode_payload(x, dtype)
    assert wire.dtype == {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[dtype]
    decoded = p.decode_payload(wire.tobytes(), dtype, x.shape)
    assert decoded.dtype == np.float32
    np.testing.assert_allclose(decoded, x, rtol=tolerance, atol=0)
    if dtype == "bf16":
        np.testing.assert_array_equal(decoded, x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_parse_compute_accepts_a_valid_request():
    header, frames = compute_message(dtype="bf16")
    request = p.parse_compute(header, frames, hidden=8, max_tokens=4)
    assert request.layer == 2 and request.x.shape == (3, 8) and request.x.dtype == np.float32
    assert request.counts.tolist() == [1, 0, 3] and request.local_ids.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("change, code", [
    ({"layer": -1}, p.BAD_REQUEST),
    ({"layer": "0"}, p.BAD_REQUEST),
    ({"tokens": 5}, p.BAD_REQUEST),       # above max_tokens
    ({"tokens": 0}, p.BAD_REQUEST),
    ({"hidden": 9}, p.BAD_REQUEST),
    ({"dtype": "f64"}, p.BAD_REQUEST),
    ({"pairs": 5}, p.BAD_FRAME),          # frames sized for 4 pairs
    ({"tokens": 2}, p.BAD_FRAME),
])
def test_parse_compute_rejects_bad_fields(change, code):
    header, frames = compute_message()
    with pytest.raises(p.ProtocolError) as error:
        p.parse_compute({**header, **change}, frames, hidden=8, max_tokens=4)
    assert error.value.code == code


@pytest.mark.parametrize("counts", [(1, 0, 2), (5, -1, 0), (-1, 0, 5)])
def test_parse_compute_rejects_counts_that_do_not_sum_to_pairs(counts):
    header, frames = compute_message(counts=counts)
    with pytest.raises(p.ProtocolError) as error:
        p.parse_compute(header, frames, hidden=8, max_tokens=4)
    assert error.value.code == p.BAD_REQUEST


def test_parse_compute_rejects_missing_and_extra_frames():
    header, frames = compute_message()
    for bad in (frames[:3], frames + [b""]):
        with pytest.raises(p.ProtocolError) as error:
            p.parse_compute(header, bad, hidden=8, max_tokens=4)
        assert error.value.code == p.BAD_FRAME


SLOT_LAYOUT = ArenaLayout(slots=1, batch_capacity=4, hidden=8, max_pairs_per_token=2)


def test_slot_headers_round_trip():
    buffer = bytearray(SLOT_LAYOUT.slot_bytes)
    shm.write_request_header(buffer, 2**40 + 7, 3, "bf16", 4, 8, 8)
    assert shm.request_id(buffer) == 2**40 + 7
    assert shm.read_request_header(buffer, SLOT_LAYOUT) == (3, "bf16", 4, 8, False)
    shm.write_result_header(buffer, 2**40 + 7, 3, 4, 8, 12.5)
    assert shm.read_reply_header(buffer) == (2**40 + 7, 4, 8, 12.5, None)
    shm.write_error_header(buffer, 9, p.BAD_REQUEST, "é" * 1000)
    assert shm.read_reply_header(buffer) == (9, 0, 0, 0.0, (p.BAD_REQUEST,
                                                              "é" * p.MAX_ERROR_MESSAGE))


@pytest.mark.parametrize("field, value, code", [
    (0, 2, p.VERSION_MISMATCH),
    (1, shm.OP_RESULT, p.BAD_REQUEST),
    (3, -1, p.BAD_REQUEST),        # layer
    (4, 3, p.BAD_REQUEST),         # dtype code
    (5, 0, p.BAD_REQUEST),         # tokens
    (5, 5, p.BAD_REQUEST),         # above the capacity
    (6, 9, p.BAD_REQUEST),         # pairs above capacity * K
    (7, 16, p.BAD_REQUEST),        # hidden
])
def test_slot_requests_with_a_bad_field_are_refused(field, value, code):
    buffer = bytearray(SLOT_LAYOUT.slot_bytes)
    shm.write_request_header(buffer, 7, 0, "f32", 1, 2, 8)
    values = list(shm.REQUEST.unpack_from(buffer, REQUEST_HEADER_OFFSET))
    values[field] = value
    shm.REQUEST.pack_into(buffer, REQUEST_HEADER_OFFSET, *values)
    with pytest.raises(p.ProtocolError) as error:
        shm.read_request_header(buffer, SLOT_LAYOUT)
    assert error.value.code == code
    if code == p.VERSION_MISMATCH:
        assert "parent speaks version 2, daemon speaks version 1" in error.value.message


@pytest.mark.parametrize("op, error, length", [(0, 0, 0), (shm.OP_ERROR, 0, 5),
                                               (shm.OP_ERROR, 9, 5),
                                               (shm.OP_ERROR, 1, 2**31)])
def test_unreadable_slot_replies_are_protocol_errors(op, error, length):
    buffer = bytearray(SLOT_LAYOUT.slot_bytes)
    shm.REPLY.pack_into(buffer, shm.REPLY_HEADER_OFFSET, 1, op, 7, 0, 0, 0,
                                 error, 0.0, length)
    with pytest.raises(p.ProtocolError) as raised:
        shm.read_reply_header(buffer)
    assert raised.value.code == p.BAD_FRAME


def test_arena_file_is_private_and_unlinked_after_use():
    layout = ArenaLayout(slots=2, batch_capacity=16, hidden=8, max_pairs_per_token=4)
    created = Arena.create(layout)
    path = os.path.join(SHM_DIR, created.name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.path.getsize(path) == layout.size == 4096 + 2 * layout.slot_bytes
    attached = Arena.attach(created.name, ArenaLayout.from_fields(
        {"name": created.name, **layout.fields()}, hidden=8, batch_capacity_max=16))
    created.unlink()
    attached.slots[1].buffer[5000:5004] = b"abcd"
    assert created.slots[1].buffer[5000:5004] == b"abcd"
    attached.close()
    created.close()
    assert shm_segments() == set()


@pytest.mark.parametrize("name", ["../etc/passwd", "moerun-1-xyz", 7, "moerun-1-" + "0" * 15])
def test_attach_refuses_bad_names(name):
    layout = ArenaLayout(slots=1, batch_capacity=1, hidden=8, max_pairs_per_token=1)
    with pytest.raises(p.ProtocolError) as error:
        Arena.attach(name, layout)
    assert error.value.code == p.BAD_REQUEST


def test_attach_refuses_a_layout_that_does_not_match():
    layout = ArenaLayout(slots=1, batch_capacity=4, hidden=8, max_pairs_per_token=2)
    created = Arena.create(layout)
    try:
        with pytest.raises(p.ProtocolError):
            ArenaLayout.from_fields({**layout.fields(), "size": layout.size + 1}, hidden=8,
                                    batch_capacity_max=16)
        with pytest.raises(p.ProtocolError):  # same size, other capacity
            Arena.attach(created.name, ArenaLayout(1, 4, 8, 1))
    finally:
        created.unlink()
        created.close()


DEAD_PID = 2**22 + 12345  # above the default pid_max


@pytest.mark.parametrize("stale_name, live_name", [
    (f"moerun-{DEAD_PID}-{'ab' * 8}", f"moerun-{os.getpid()}-{'cd' * 8}"),
    # the CUDA driver backs a process's IPC events with cuda.shm.<n>.<pid hex>.<n>, left when it ends
    (f"cuda.shm.0.{DEAD_PID:x}.1", f"cuda.shm.0.{os.getpid():x}.1"),
], ids=["arena", "cuda-event-file"])
def test_sweep_removes_files_of_dead_processes_only(stale_name, live_name):
    stale, live = os.path.join(SHM_DIR, stale_name), os.path.join(SHM_DIR, live_name)
    for path in (stale, live):
        with open(path, "wb"):
            pass
    try:
        removed = sweep_stale_segments()
        assert stale_name in removed
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


def test_doorbell_wakes_a_sleeping_waiter_and_times_out():
    arena = Arena.create(ArenaLayout(slots=1, batch_capacity=1, hidden=8, max_pairs_per_token=1))
    arena.unlink()
    bell = arena.doorbell
    try:
        start = time.monotonic()
        assert not bell.wait(bell.value(), spin_s=0.0, sleep_s=0.05)
        assert 0.04 < time.monotonic() - start < 1.0
        woke = []
        waiter = threading.Thread(
            target=lambda: woke.append((bell.wait(0, spin_s=0.0, sleep_s=5.0), time.monotonic())))
        waiter.start()
        time.sleep(0.05)
        rang = time.monotonic()
        bell.ring()
        waiter.join(5)
        assert woke and woke[0][0] and woke[0][1] - rang < 0.5
    finally:
        arena.close()


def test_the_kernel_fence_of_weakly_ordered_cpus_runs_here_too():
    doorbell._kernel_fence()
    assert (doorbell.fence is doorbell._no_fence) == (platform.machine() == "x86_64")


def test_without_futex_the_message_points_to_the_stream_transport(monkeypatch):
    monkeypatch.setattr(doorbell, "_syscall", None)
    with pytest.raises(doorbell.FutexUnavailable, match="--transport stream"):
        Arena.create(ArenaLayout(slots=1, batch_capacity=1, hidden=8, max_pairs_per_token=1))
    assert shm_segments() == set()
