"""Garbage against a live `moerun daemon` serving a real model: 1000 random, truncated,
oversized, wrong-version, wrong-op, wrong-dtype, wrong-shape and wrong-frame messages from
the session owner's own socket. Each gets an error reply (or, past the frame size limit,
the connection is dropped); afterwards a valid COMPUTE still returns the right answer."""
from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
import zmq

from moerun.backends.numpy_backend import expert_store
from moerun.gguf.reader import GGUFFile
from moerun.ipc.protocol import PROTOCOL_VERSION
from moerun.models import load_spec
from tests.support.daemon_fixtures import running_daemons
from tests.support.hf_models import tiny_model
from tests.support.to_gguf import write_gguf

ASSIGNED = {0: [1, 4, 6], 2: [0, 7]}
N_MESSAGES = 1000
ANSWER_WITHIN_MS = 60_000    # for every reply (HELLO's from a daemon still starting), on a loaded machine too
ERROR_CODES = {"bad_frame", "version_mismatch", "fingerprint_mismatch", "busy", "no_session", "bad_request",
               "not_ready", "internal"}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A daemon for a real model and a raw DEALER that owns its session, experts assigned."""
    folder = tmp_path_factory.mktemp("fuzz")
    path = write_gguf(tiny_model("olmoe", seed=8), folder / "m.gguf", "Q8_0")
    with GGUFFile(path) as gguf:
        fingerprint, spec = gguf.fingerprint(), load_spec(gguf)
    with running_daemons(path, 1, folder) as endpoints:
        context = zmq.Context()
        try:
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoints[0])
            parent = {"pid": os.getpid(), "hostname": "fuzzer", "boot_id": ""}
            hello = reply(dealer, [pack(op="hello", id=1, fingerprint=fingerprint, parent=parent)])
            assert hello is not None and hello["op"] == "hello", hello
            dealer.send_multipart([pack(op="assign", id=2, experts={str(k): v for k, v in ASSIGNED.items()})])
            while (header := receive(dealer)) is not None and header["op"] == "progress":
                pass
            assert header is not None and header["op"] == "ready", header
            yield dealer, path, spec
        finally:
            context.destroy(linger=0)


def pack(**fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields})


def receive(dealer, timeout_ms: int = ANSWER_WITHIN_MS) -> dict | None:
    if not dealer.poll(timeout_ms):
        return None
    return msgpack.unpackb(dealer.recv_multipart()[0])


def reply(dealer, parts) -> dict | None:
    dealer.send_multipart(parts)
    return receive(dealer)


def valid_compute(rng, request_id, hidden):
    layer = int(rng.choice(list(ASSIGNED)))
    tokens = int(rng.integers(1, 6))
    counts = rng.integers(0, len(ASSIGNED[layer]) + 1, tokens).astype(np.int32)
    local_ids = np.concatenate([rng.permutation(len(ASSIGNED[layer]))[:c] for c in counts]).astype(np.int32)
    weights = rng.random(len(local_ids)).astype(np.float32)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    header = {"v": PROTOCOL_VERSION, "op": "compute", "id": request_id, "layer": layer, "dtype": "f32",
              "tokens": tokens, "pairs": len(local_ids), "hidden": hidden}
    return header, [x, counts, local_ids, weights]


def garbage(rng, request_id, hidden) -> list[bytes]:
    header, arrays = valid_compute(rng, request_id, hidden)
    frames = [a.tobytes() for a in arrays]
    kind = int(rng.integers(12))
    if kind == 0:
        return [rng.bytes(int(rng.integers(0, 200)))] + frames[: int(rng.integers(0, 5))]
    if kind == 1:
        packed = msgpack.packb(header)
        return [packed[: int(rng.integers(0, len(packed)))]] + frames
    changes = {
        2: {"v": [0, 2, 99, "1", None, 1.5][int(rng.integers(6))]},
        3: {"op": ["result", "pong", "", "COMPUTE", 7, None, "x" * 300][int(rng.integers(7))]},
        4: {"dtype": ["f64", "F32", "", None, 3, "int8"][int(rng.integers(6))]},
        5: {"tokens": int(header["tokens"] + rng.integers(1, 5))},
        6: {"pairs": int(header["pairs"] + rng.integers(1, 5))},
        7: {"layer": [1, 3, -1, 99, "0", None][int(rng.integers(6))]},
        8: {"hidden": int(hidden + rng.integers(1, 100))},
        9: {"tokens": int(rng.integers(5000, 10**9))},
    }
    if kind in changes:
        return [msgpack.packb({**header, **changes[kind]})] + frames
    if kind == 10:   # local ids outside the layer's assignment
        arrays[2] = arrays[2] + len(ASSIGNED[header["layer"]])
        if len(arrays[2]) == 0:
            return [msgpack.packb(header)] + frames[:3]
        return [msgpack.packb(header)] + [a.tobytes() for a in arrays]
    return [msgpack.packb(header)] + frames[: int(rng.integers(0, 4))] + [rng.bytes(8)] * int(rng.integers(2, 4))


def expected(path, spec, layer, x, counts, local_ids, weights) -> np.ndarray:
    with GGUFFile(path) as gguf:
        rows = np.repeat(np.arange(len(counts)), counts)
        experts = np.asarray(ASSIGNED[layer])[local_ids]
        return expert_store(gguf, spec, 1 << 30).grouped_ffn(layer, x, rows, experts, weights)


def test_garbage_then_a_valid_request(session):
    dealer, path, spec = session
    rng = np.random.default_rng(0)
    answered = 0
    for request_id in range(100, 100 + N_MESSAGES):
        header = reply(dealer, garbage(rng, request_id, spec.hidden))
        assert header is not None, f"message {request_id} got no reply"
        assert header["op"] == "error" and header["code"] in ERROR_CODES, header
        answered += 1
    assert answered == N_MESSAGES
    for request_id in range(5000, 5005):
        header, arrays = valid_compute(rng, request_id, spec.hidden)
        dealer.send_multipart([msgpack.packb(header)] + [a.tobytes() for a in arrays])
        assert dealer.poll(ANSWER_WITHIN_MS)
        parts = dealer.recv_multipart()
        result = msgpack.unpackb(parts[0])
        assert result["op"] == "result" and result["id"] == request_id, result
        got = np.frombuffer(parts[1], np.float32).reshape(header["tokens"], spec.hidden)
        np.testing.assert_allclose(got, expected(path, spec, header["layer"], *arrays), rtol=1e-6, atol=1e-6)
