"""The parent's side of an attached arena: COMPUTE requests written into slots, replies read
back from them. Up to `slots` requests are in flight; a submit that finds every slot busy
completes the oldest request first and keeps its result for wait().

Shape legend: T tokens, H hidden size, P routed pairs.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from moerun.ipc import protocol as p
from moerun.ipc import shm
from moerun.ipc.doorbell import fence
from moerun.ipc.protocol import DaemonDied, DaemonError, DaemonTimeout, ProtocolError
from moerun.ipc.shm import STATE_DETACHED, Arena

PARENT_SPIN_S = 0.0002   # spin this long on a reply before sleeping in futex
WAIT_SLICE_S = 0.02      # futex sleeps between deadline / liveness / detach checks


class SharedChannel:
    def __init__(self, arena: Arena, endpoint: str, counters, spin_s: float = PARENT_SPIN_S):
        self.arena, self.endpoint, self.counters, self.spin_s = arena, endpoint, counters, spin_s
        self.in_flight: dict[int, tuple[int, int, int]] = {}  # id -> (slot, T, H), oldest first
        self.done: dict[int, np.ndarray | DaemonError] = {}   # finished before wait() asked
        self._busy = [False] * len(arena.slots)               # a live request owns the slot

    def submit(self, request_id: int, layer: int, x: np.ndarray, counts: np.ndarray,
               local_ids: np.ndarray, weights: np.ndarray, dtype: str, timeout_s: float,
               alive: Callable[[], bool] | None) -> None:
        tokens, hidden = x.shape
        pairs = len(local_ids)
        layout = self.arena.layout
        if tokens > layout.batch_capacity or pairs > layout.max_pairs or hidden != layout.hidden:
            raise ValueError(f"x [{tokens}, {hidden}] with {pairs} pairs does not fit the arena's "
                             f"batch capacity {layout.batch_capacity} (hidden {layout.hidden}, "
                             f"{layout.max_pairs} pairs)")
        self._raise_if_detached()
        index = self._free_slot(timeout_s, alive)
        slot = self.arena.slots[index]
        slot.write_request_frames(dtype, x, counts, local_ids, weights)
        shm.write_request_header(slot.buffer, request_id, layer, dtype, tokens, pairs, hidden)
        self._ring(index, request_id, tokens,
                   shm.REQUEST.size + x.size * p.WIRE_ITEMSIZE[dtype] + 4 * tokens + 8 * pairs)

    def post(self, index: int, request_id: int, layer: int, dtype: str, tokens: int) -> None:
        """A padded request whose frames are already in idle slot `index` (a GPU parent
        writes them from the device): x [T, H] in `dtype`, ids and weights [T, K]."""
        layout = self.arena.layout
        self._raise_if_detached()
        if not self.idle(index):
            raise RuntimeError(f"slot {index} still holds a request")
        slot = self.arena.slots[index]
        pairs = tokens * layout.max_pairs_per_token
        shm.write_request_header(slot.buffer, request_id, layer, dtype, tokens, pairs,
                                   layout.hidden, padded=True)
        self._ring(index, request_id, tokens,
                   shm.REQUEST.size + tokens * layout.hidden * p.WIRE_ITEMSIZE[dtype] + 8 * pairs)

    def forward(self, request_id: int, sequence: int, start: int, x: np.ndarray, dtype: str, timeout_s: float,
                alive: Callable[[], bool] | None) -> np.ndarray:
        """A layer shard's step through a slot: x [T, H] in `dtype` -> the f32 [T, H] reply."""
        tokens, hidden = x.shape
        layout = self.arena.layout
        if tokens > layout.batch_capacity or hidden != layout.hidden:
            raise ValueError(f"x [{tokens}, {hidden}] does not fit the arena's batch capacity "
                             f"{layout.batch_capacity} (hidden {layout.hidden})")
        self._raise_if_detached()
        deadline = time.monotonic() + timeout_s
        index = self._free_slot(timeout_s, alive)
        slot = self.arena.slots[index]
        slot.write_x(dtype, x)
        shm.write_forward_header(slot.buffer, request_id, sequence, start, dtype, tokens, hidden)
        self._ring(index, request_id, tokens, shm.FORWARD_REQUEST.size + x.size * p.WIRE_ITEMSIZE[dtype])
        return self.wait(request_id, deadline, alive)

    def post_forward(self, index: int, request_id: int, sequence: int, start: int, tokens: int) -> None:
        """A layer shard's FORWARD whose hidden state [T, H] is already in the shard's device
        buffers (transport "device"): the header alone goes into idle slot `index`."""
        layout = self.arena.layout
        if tokens > layout.batch_capacity:
            raise ValueError(f"{tokens} tokens do not fit the arena's batch capacity {layout.batch_capacity}")
        self._raise_if_detached()
        if not self.idle(index):
            raise RuntimeError(f"slot {index} still holds a request")
        shm.write_forward_header(self.arena.slots[index].buffer, request_id, sequence, start, "f32", tokens,
                                 layout.hidden)
        self._ring(index, request_id, tokens, shm.FORWARD_REQUEST.size)

    def _ring(self, index: int, request_id: int, tokens: int, sent_bytes: int) -> None:
        """The request written into slot `index` goes out: its sequence word, then the doorbell."""
        slot = self.arena.slots[index]
        fence()
        slot.request_seq = slot.request_seq + 1
        self.arena.doorbell.ring()
        self._busy[index] = True
        self.in_flight[request_id] = (index, tokens, self.arena.layout.hidden)
        self.counters.bytes_sent += sent_bytes

    def collect(self, request_id: int, deadline: float, alive: Callable[[], bool] | None) -> None:
        """Wait for the daemon's answer to a posted request; its result stays where the
        daemon put it. Raises DaemonError for an error reply."""
        index = self.in_flight[request_id][0]
        start = time.perf_counter()
        try:
            self._wait_slot(index, deadline, alive, request_id)
        except (DaemonTimeout, DaemonDied, DaemonError):
            del self.in_flight[request_id]
            self._busy[index] = False
            raise
        finally:
            self.counters.wait_seconds += time.perf_counter() - start
        error = self._reply(request_id)
        if error is not None:
            raise error

    def wait(self, request_id: int, deadline: float,
             alive: Callable[[], bool] | None) -> np.ndarray:
        result = self.done.pop(request_id, None)
        if result is None:
            index = self.in_flight[request_id][0]
            try:
                self._wait_slot(index, deadline, alive, request_id)
            except (DaemonTimeout, DaemonDied, DaemonError):
                del self.in_flight[request_id]
                self._busy[index] = False  # the slot is reused once the daemon answers it
                raise
            result = self._read_reply(request_id)
        if type(result) is DaemonError:
            raise result
        return result

    def close(self) -> None:
        self.arena.close()

    def _free_slot(self, timeout_s: float, alive) -> int:
        """A slot with no live request whose last request the daemon has answered; when there
        is none, complete the oldest request (its result waits in `done`)."""
        index = self._idle_slot()
        if index is not None:
            return index
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        try:
            while index is None:
                if self.in_flight:
                    oldest = next(iter(self.in_flight))
                    self._wait_slot(self.in_flight[oldest][0], deadline, alive, oldest)
                    self.done[oldest] = self._read_reply(oldest)
                else:  # every slot still holds a request abandoned after a timeout
                    pending = [i for i, slot in enumerate(self.arena.slots) if slot.pending()]
                    self._wait_slot(pending[0], deadline, alive, None)
                index = self._idle_slot()
            return index
        finally:
            self.counters.wait_seconds += time.perf_counter() - start

    def idle(self, index: int) -> bool:
        """No live request owns slot `index` and the daemon answered its last one."""
        return not self._busy[index] and not self.arena.slots[index].pending()

    def _idle_slot(self) -> int | None:
        for index in range(len(self.arena.slots)):
            if self.idle(index):
                return index
        return None

    def _wait_slot(self, index: int, deadline: float, alive, request_id: int | None) -> None:
        """Wait until the daemon answered slot `index` (for request_id, None: any request)."""
        slot = self.arena.slots[index]
        expected, reply = slot.request_seq, slot.reply
        seen, spin_s = reply.value(), self.spin_s
        while seen != expected:
            sleep_s = min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))
            if not reply.wait(seen, spin_s, sleep_s):
                spin_s = 0.0
                self._check(deadline, alive, request_id)
            seen = reply.value()
        fence()

    def _raise_if_detached(self) -> None:
        if self.arena.state == STATE_DETACHED:
            raise DaemonError(p.NO_SESSION, "the daemon ended this session (another parent "
                                            "took over, or it stopped)", self.endpoint)

    def _check(self, deadline: float, alive, request_id: int | None) -> None:
        what = "a free slot" if request_id is None else f"compute request {request_id}"
        self._raise_if_detached()
        if alive is not None and not alive():
            raise DaemonDied(f"daemon {self.endpoint} died while serving {what}")
        if time.monotonic() >= deadline:
            raise DaemonTimeout(f"daemon {self.endpoint}: no reply to {what} in time")

    def _read_reply(self, request_id: int) -> np.ndarray | DaemonError:
        index, tokens, _ = self.in_flight[request_id]
        error = self._reply(request_id)
        return error if error is not None else self.arena.slots[index].read_result(tokens)

    def _reply(self, request_id: int) -> DaemonError | None:
        """Check the reply header of a finished request and free its slot."""
        index, tokens, hidden = self.in_flight.pop(request_id)
        self._busy[index] = False
        slot = self.arena.slots[index]
        try:
            reply_id, reply_tokens, reply_hidden, compute_us, error = shm.read_reply_header(
                slot.buffer)
        except ProtocolError as e:
            return DaemonError(p.BAD_FRAME, f"unreadable slot reply: {e}", self.endpoint)
        if error is not None:
            return DaemonError(*error, self.endpoint)
        if (reply_id, reply_tokens, reply_hidden) != (request_id, tokens, hidden):
            return DaemonError(p.BAD_FRAME, f"slot reply is for request {reply_id} "
                                            f"[{reply_tokens}, {reply_hidden}], not request "
                                            f"{request_id} [{tokens}, {hidden}]", self.endpoint)
        self.counters.bytes_received += shm.REPLY.size + tokens * hidden * 4
        self.counters.compute_seconds += compute_us / 1e6
        return None
