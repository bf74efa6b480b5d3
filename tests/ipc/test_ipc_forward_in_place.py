"""A layer shard's FORWARD whose hidden state lives in the shard's own buffers (transport
"device"): the slot carries the header alone, the server hands it to the handler's in-place
call, and the RESULT header comes back with no frame; a bad request is a structured error and
the slot serves the next one. A real server (in a thread) and a real client over a real arena;
the device buffers themselves are the GPU tests' (tests/gpu/test_gpu_split.py)."""
from __future__ import annotations

import threading

import pytest

from moerun.ipc.client import DaemonClient
from moerun.ipc.protocol import DaemonError
from moerun.ipc.server import Server

HIDDEN = 32
FINGERPRINT = "in-place-shard"


class InPlaceShard:
    """A handler that takes FORWARD in place: it records each call and holds one sequence."""

    def __init__(self):
        self.calls: list[tuple[int, int, int, int]] = []
        self.length = 0

    def info(self) -> dict:
        return {"fingerprint": FINGERPRINT, "device": "cuda:0", "backend": "cuda", "model": "fake",
                "n_layers": 4, "n_experts": 8, "hidden": HIDDEN, "layers": [2, 4], "ctx": 64}

    def attach(self, arena, transport, header):
        assert transport == "device" and header["incoming"] == [b"\1" * 64]
        return {"device_buffers": {"memory": b"\2" * 64, "bytes": 0, "outgoing": [b"\3" * 64]}}, self.forward_slot, None

    def forward_slot(self, index: int, sequence: int, start: int, tokens: int) -> None:
        if start != self.length:
            raise ValueError(f"position {start} does not continue {self.length}")
        self.calls.append((index, sequence, start, tokens))
        self.length = start + tokens

    def release(self) -> None:
        self.length = 0

    def stats(self) -> dict:
        return {"calls": len(self.calls)}


@pytest.fixture
def served(tmp_path):
    handler = InPlaceShard()
    server = Server(f"ipc://{tmp_path}/shard.sock", handler, batch_capacity_max=16)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = DaemonClient(server.endpoint, connect_timeout_s=10)
    try:
        yield handler, client
    finally:
        client.close()
        server.stop()
        thread.join(10)


def test_a_header_only_forward_reaches_the_handlers_in_place_call(served):
    handler, client = served
    client.hello(FINGERPRINT)
    reply = client.attach_shared(transport="device", incoming=[b"\1" * 64], batch_capacity=16, hidden=HIDDEN,
                                 max_pairs_per_token=1, slots=1)
    assert reply["device_buffers"]["outgoing"] == [b"\3" * 64]
    for start, tokens in ((0, 5), (5, 1), (6, 1)):
        client.collect(client.post_forward(7, start, tokens), 10.0)
    assert handler.calls == [(0, 7, 0, 5), (0, 7, 5, 1), (0, 7, 6, 1)]
    with pytest.raises(DaemonError, match="forward: ValueError: position 3 does not continue 7"):
        client.collect(client.post_forward(7, 3, 1), 10.0)
    client.collect(client.post_forward(8, 7, 2), 10.0)                 # the slot serves the next request
    assert handler.calls[-1] == (0, 8, 7, 2)
    with pytest.raises(ValueError, match="batch capacity"):
        client.post_forward(8, 9, 17)
