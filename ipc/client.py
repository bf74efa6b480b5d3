"""The parent's handle on one expert daemon: HELLO, ASSIGN, an optional shared arena, and
COMPUTE requests that can be in flight while the parent does other work.

Control ops always travel over ZeroMQ; COMPUTE goes through the arena once attach_shared()
succeeded (transport "shared"), else inside ZeroMQ frames (transport "stream").
One thread at a time may use a client (a ZeroMQ socket is not thread-safe): the parent's rig
holds a lock per daemon around every use. Reading `last_heard` or `counters` from another
thread is fine.
Shape legend: T tokens, H hidden size, K experts per token, P routed pairs.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import msgpack
import numpy as np
import zmq

from moerun.errors import UsageError
from moerun.ipc import protocol as p
from moerun.ipc.curve import CurveClientKeys
from moerun.ipc.dealer_monitor import DealerMonitor
from moerun.ipc.protocol import DaemonDied, DaemonError, DaemonTimeout, DaemonUnreachable, ProtocolError
from moerun.ipc.shared_channel import PARENT_SPIN_S, SharedChannel
from moerun.ipc.shm import Arena, ArenaLayout
from moerun.ipc.sockets import new_dealer, receive

__all__ = ["Counters", "DaemonClient", "DaemonDied", "DaemonError", "DaemonTimeout", "DaemonUnreachable"]

HELLO_RESEND_S = 1.0       # a daemon that is still starting gets the HELLO again
POLL_SLICE_S = 0.02        # socket waits between deadline and liveness checks
SUBMIT_TIMEOUT_S = 60.0    # how long a shared submit may wait for a free slot


@dataclass
class Counters:
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_seconds: float = 0.0      # time blocked in wait() and submit()
    compute_seconds: float = 0.0   # sum of the daemon's compute_us

    def as_dict(self) -> dict:
        return asdict(self)


class DaemonClient:
    def __init__(self, endpoint: str, *, context: zmq.Context | None = None,
                 connect_timeout_s: float = 30.0, spin_s: float = PARENT_SPIN_S,
                 curve: CurveClientKeys | None = None, expect_listening: bool = False):
        """expect_listening: the daemon should be listening already (it was started elsewhere), so
        a connection attempt that fails is final (DaemonUnreachable); else (a process that may
        still be starting) it is retried until connect_timeout_s."""
        self.endpoint = endpoint
        self.curve = curve                    # this parent's CURVE keys and the daemon's public key
        self.connect_timeout_s = connect_timeout_s
        self.spin_s = spin_s
        self.expect_listening = expect_listening
        self.info: dict = {}
        self.transport = "stream"
        self.counters = Counters()
        self._last_id = 0
        self.last_heard = time.monotonic()    # when the daemon's last message or slot reply came
        self._stream_pending: dict[int, tuple[int, int]] = {}   # request id -> (T, H)
        self._stream_done: dict[int, np.ndarray | DaemonError] = {}
        self._shared: SharedChannel | None = None
        self._socket: zmq.Socket | None = None
        self._monitor: DealerMonitor | None = None
        self._own_context = context is None
        self._context = context if context is not None else zmq.Context()
        try:
            self._connect()                   # self._socket, self._monitor, self._poller
        except BaseException:
            self.close()
            raise

    # -- session ----------------------------------------------------------------------------

    def hello(self, fingerprint: str, alive: Callable[[], bool] | None = None, model: str = "") -> dict:
        """Start the session, or start it again: requests of an earlier session are
        forgotten and its arena dropped. `model` names the parent's model file in a mismatch.
        Retries until connect_timeout_s while no answer comes; raises at once the refusals
        that will not change: DaemonError for an error reply (busy, fingerprint_mismatch...) or a
        handshake the daemon refused (unauthenticated), DaemonUnreachable when a connection
        attempt fails (with expect_listening), DaemonDied when alive() says False."""
        self._forget_session()
        self._monitor.forget()
        if self._monitor.refused_for_good:     # that socket never connects again
            self.reconnect()
        deadline = time.monotonic() + self.connect_timeout_s
        sent: set[int] = set()
        resend_at = 0.0
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise DaemonTimeout(f"daemon {self.endpoint}: no HELLO reply within "
                                    f"{self.connect_timeout_s:g} s (is it running?)")
            if now >= resend_at:   # not sent while the DEALER has no connection that takes it
                request_id = self._send(p.HELLO, wait=False, fingerprint=fingerprint, model=model,
                                        parent=p.host_identity())
                if request_id is not None:
                    sent.add(request_id)
                resend_at = now + HELLO_RESEND_S
            message = self._receive(min(deadline, resend_at, now + POLL_SLICE_S) - now)
            if message is None:
                self._raise_if_refused()
                if alive is not None and not alive():
                    raise DaemonDied(f"daemon {self.endpoint} died before answering HELLO")
                continue
            reply_id = message[0].get("id")
            if reply_id in sent or (reply_id is None and message[0]["op"] == p.ERROR):
                header = self._raise_if_error(message[0])
                break
        if header.get("fingerprint") != fingerprint:
            raise DaemonError(p.FINGERPRINT_MISMATCH, p.fingerprint_mismatch(
                fingerprint, model, header.get("fingerprint"), header.get("model", "")), self.endpoint)
        self.info = p.own_fields(header)
        return self.info

    def same_host(self) -> bool:
        me = p.host_identity()
        return bool(me["boot_id"]) and (self.info.get("boot_id"), self.info.get("hostname")) == (
            me["boot_id"], me["hostname"])

    def attach_shared(self, *, batch_capacity: int, hidden: int, max_pairs_per_token: int,
                      slots: int = 4, transport: str = "shared",
                      alive: Callable[[], bool] | None = None, **fields) -> dict:
        """Create an arena, have the daemon map it, then unlink its name at once. With
        transport "device" (a GPU daemon) the payloads live in the daemon's device buffers,
        the arena carries headers and doorbells only. Returns the daemon's ATTACH reply
        fields (for "device": the IPC handles of its buffers and events). `fields` go into
        the ATTACH request as they are (for "device": the parent's event handles)."""
        if not 1 <= batch_capacity <= p.MAX_BATCH_CAPACITY:
            raise UsageError(f"batch capacity {batch_capacity} not in [1, {p.MAX_BATCH_CAPACITY}]")
        arena = Arena.create(ArenaLayout(slots, batch_capacity, hidden, max_pairs_per_token))
        try:
            reply = self._request(p.ATTACH, self.connect_timeout_s, alive, name=arena.name,
                                  transport=transport, **arena.layout.fields(), **fields)
        except BaseException:
            arena.close()
            raise
        finally:
            arena.unlink()
        self._drop_shared()
        self._shared = SharedChannel(arena, self.endpoint, self.counters, self.spin_s)
        self.transport = transport
        return p.own_fields(reply)

    @property
    def arena(self) -> Arena | None:
        return self._shared.arena if self._shared is not None else None

    def assign(self, experts: dict[int, list[int]],
               progress: Callable[[int, int], None] | None = None,
               timeout_s: float = 600.0, alive: Callable[[], bool] | None = None) -> None:
        """Give the daemon its experts: {layer: [global ids]}, whose order defines local ids."""
        wire = {str(int(layer)): [int(e) for e in ids] for layer, ids in experts.items()}
        request_id = self._send(p.ASSIGN, experts=wire)
        deadline = time.monotonic() + timeout_s
        while True:
            header = self._raise_if_error(self._await(request_id, deadline, alive, "assign")[0])
            if header["op"] == p.READY:
                return
            if header["op"] == p.PROGRESS and progress is not None:
                progress(int(header["done"]), int(header["total"]))

    def stats(self, timeout_s: float = 10.0) -> dict:
        header = self._request(p.STATS, timeout_s)
        return p.own_fields(header)

    def ping(self, timeout_s: float = 5.0, alive: Callable[[], bool] | None = None) -> float:
        """Round-trip time of a PING, in seconds."""
        start = time.perf_counter()
        self._request(p.PING, timeout_s, alive)
        return time.perf_counter() - start

    def bye(self, timeout_s: float = 10.0) -> None:
        """End the session (the daemon drops its experts and the arena)."""
        try:
            self._request(p.BYE, timeout_s)
        finally:
            self._drop_shared()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the daemon process to stop serving."""
        try:
            self._request(p.SHUTDOWN, timeout_s)
        finally:
            self._drop_shared()

    def reconnect(self) -> None:
        """A new socket to the endpoint, for a daemon process that replaced the one there:
        nothing queued for the old process is delivered to the new one. hello() comes next."""
        self._close_socket()
        self._connect()

    def close(self) -> None:
        """Unmap the arena, close the socket and its monitor, and the context if this client
        made it; never blocks. Safe to call again."""
        self._drop_shared()
        self._close_socket()
        if self._own_context and not self._context.closed:
            self._context.destroy(linger=0)

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- compute ----------------------------------------------------------------------------

    def submit(self, layer: int, x: np.ndarray, counts: np.ndarray, local_ids: np.ndarray,
               weights: np.ndarray, dtype: str, *, timeout_s: float = SUBMIT_TIMEOUT_S,
               alive: Callable[[], bool] | None = None) -> int:
        """Send x f32 [T, H], counts [T], local_ids [P], weights [P]; returns the request id.
        Do not modify the arrays before wait() returns (stream sends large ones zero-copy)."""
        if dtype not in p.PAYLOAD_DTYPES:
            raise UsageError(f"unknown payload dtype {dtype!r}")
        counts = np.ascontiguousarray(counts, dtype=np.int32)
        local_ids = np.ascontiguousarray(local_ids, dtype=np.int32)
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        tokens, hidden = x.shape
        pairs = len(local_ids)
        if counts.shape != (tokens,) or local_ids.shape != (pairs,) or weights.shape != (pairs,):
            raise ValueError(f"counts {counts.shape}, local_ids {local_ids.shape}, weights "
                             f"{weights.shape} do not match {tokens} tokens")
        request_id = self._next_id()
        self.counters.calls += 1
        if self._shared is not None:
            self._shared.submit(request_id, int(layer), x, counts, local_ids, weights, dtype,
                                timeout_s, alive)
            return request_id
        payload = p.encode_payload(x, dtype)
        header = p.compute_header(request_id, int(layer), dtype, tokens, pairs, hidden)
        try:
            self._socket.send_multipart([header, payload, counts, local_ids, weights], copy=False)
        except zmq.Again:
            raise DaemonTimeout(f"daemon {self.endpoint}: send queue full") from None
        self._stream_pending[request_id] = (tokens, hidden)
        self.counters.bytes_sent += (len(header) + payload.nbytes + counts.nbytes
                                     + local_ids.nbytes + weights.nbytes)
        return request_id

    def post(self, slot: int, layer: int, dtype: str, tokens: int) -> int:
        """A padded request already written into the arena slot or the daemon's device
        buffers for it (see SharedChannel.post); returns the request id."""
        request_id = self._next_id()
        self.counters.calls += 1
        self._shared.post(slot, request_id, int(layer), dtype, tokens)
        return request_id

    def post_forward(self, sequence: int, start: int, tokens: int) -> int:
        """A layer shard's step whose hidden state is in its device buffers (transport "device"),
        through slot 0; collect() waits for the shard to have queued its work. Returns the
        request id."""
        request_id = self._next_id()
        self.counters.calls += 1
        self._shared.post_forward(0, request_id, sequence, start, tokens)
        return request_id

    def forward(self, sequence: int, start: int, x: np.ndarray, dtype: str, timeout_s: float,
                alive: Callable[[], bool] | None = None) -> np.ndarray:
        """A layer shard's step: x f32 [T, H] at positions start.. of `sequence` (start 0 begins
        it) -> f32 [T, H] after the shard's last layer: through the attached arena (the reply
        f32), else in ZeroMQ frames (both ways in the payload dtype)."""
        tokens, hidden = x.shape
        request_id = self._next_id()
        if self._shared is not None:
            self.counters.calls += 1
            started = time.perf_counter()
            try:
                out = self._shared.forward(request_id, sequence, start, x, dtype, timeout_s, alive)
            finally:
                self.counters.wait_seconds += time.perf_counter() - started
            self.last_heard = time.monotonic()
            return out
        header = p.forward_header(request_id, sequence, start, dtype, tokens, hidden)
        payload = p.encode_payload(x, dtype)
        started = time.perf_counter()
        try:
            self._socket.send_multipart([header, payload], copy=False)
        except zmq.Again:
            raise DaemonTimeout(f"daemon {self.endpoint}: send queue full") from None
        self.counters.calls += 1
        self.counters.bytes_sent += len(header) + payload.nbytes
        try:
            reply, frames = self._await(request_id, time.monotonic() + timeout_s, alive, p.FORWARD)
        finally:
            self.counters.wait_seconds += time.perf_counter() - started
        self._raise_if_error(reply)
        if (reply["op"] != p.HIDDEN or len(frames) != 1
                or len(frames[0]) != tokens * hidden * p.WIRE_ITEMSIZE[dtype]):
            raise DaemonError(p.BAD_FRAME, f"bad reply to a [{tokens}, {hidden}] forward: {reply}", self.endpoint)
        self.counters.compute_seconds += float(reply.get("compute_us", 0.0)) / 1e6
        return p.decode_payload(frames[0], dtype, (tokens, hidden))

    def collect(self, request_id: int, timeout_s: float,
                alive: Callable[[], bool] | None = None) -> None:
        """Wait for a posted request's reply; the result stays in the slot or device buffer."""
        self._shared.collect(request_id, time.monotonic() + timeout_s, alive)
        self.last_heard = time.monotonic()

    def slot_idle(self, slot: int) -> bool:
        return self._shared.idle(slot)

    def wait(self, request_id: int, timeout_s: float,
             alive: Callable[[], bool] | None = None) -> np.ndarray:
        """The f32 [T, H] result of a submitted request."""
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        try:
            if self._shared is not None and (request_id in self._shared.in_flight
                                             or request_id in self._shared.done):
                result = self._shared.wait(request_id, deadline, alive)
                self.last_heard = time.monotonic()
                return result
            result = self._stream_done.pop(request_id, None)
            if result is None:
                if request_id not in self._stream_pending:
                    raise KeyError(f"no request {request_id} pending on {self.endpoint}")
                try:
                    header, frames = self._await(request_id, deadline, alive, request_id)
                except (DaemonTimeout, DaemonDied):
                    del self._stream_pending[request_id]
                    raise
                result = self._stream_result(request_id, header, frames)
            if type(result) is DaemonError:
                raise result
            return result
        finally:
            self.counters.wait_seconds += time.perf_counter() - start

    # -- messages ---------------------------------------------------------------------------

    def _connect(self) -> None:
        self._socket = new_dealer(self._context, self.curve)
        self._monitor = DealerMonitor(self._socket, self.endpoint, self.curve)   # before any event can come
        self._socket.connect(self.endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)

    def _close_socket(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def _next_id(self) -> int:
        self._last_id += 1
        return self._last_id

    def _send(self, op: str, *, wait: bool = True, **fields) -> int | None:
        """Send a control message; its request id. wait=False: None at once when the socket
        cannot take it now (no connection to the daemon, or its queue full)."""
        request_id = self._next_id()
        header = p.pack_header(op, id=request_id, **fields)
        try:
            self._socket.send(header, 0 if wait else zmq.NOBLOCK)
        except zmq.Again:
            if not wait:
                return None
            raise DaemonTimeout(f"daemon {self.endpoint}: send queue full") from None
        self.counters.bytes_sent += len(header)
        if self._shared is not None:
            self._shared.arena.announce_control_message()
        return request_id

    def _request(self, op: str, timeout_s: float, alive: Callable[[], bool] | None = None,
                 **fields) -> dict:
        request_id = self._send(op, **fields)
        return self._raise_if_error(self._await(request_id, time.monotonic() + timeout_s, alive,
                                                op)[0])

    def _receive(self, timeout_s: float, spin_s: float = 0.0) -> tuple[dict, list] | None:
        """The next message (header, frames), or None after timeout_s; for the first spin_s
        it polls without sleeping."""
        spin_end = time.perf_counter() + spin_s
        while not self._poller.poll(0):
            if time.perf_counter() >= spin_end:
                if not self._poller.poll(max(0, int(timeout_s * 1000))):
                    return None
                break
            os.sched_yield()
        parts = receive(self._socket, 1)
        self.last_heard = time.monotonic()
        self.counters.bytes_received += sum(len(part) for part in parts)
        try:
            header = p.unpack_header(parts[0], "daemon", "parent")
        except ProtocolError as e:
            raise DaemonError(e.code, e.message + _error_text(parts[0]), self.endpoint) from None
        return header, parts[1:]

    def _await(self, request_id: int, deadline: float, alive, what) -> tuple[dict, list]:
        """The next message for request_id, or an error reply without an id (a request the
        daemon could not read); other compute replies are kept, stale ones dropped."""
        spin_s = self.spin_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DaemonTimeout(f"daemon {self.endpoint}: no reply to {_what(what)} in time")
            message = self._receive(min(remaining, POLL_SLICE_S), spin_s)
            spin_s = 0.0
            if message is None:
                self._raise_if_refused()
                if alive is not None and not alive():
                    raise DaemonDied(f"daemon {self.endpoint} died while serving {_what(what)}")
                continue
            header, frames = message
            reply_id = header.get("id")
            if reply_id == request_id or (reply_id is None and header["op"] == p.ERROR):
                return header, frames
            if reply_id in self._stream_pending:
                self._stream_done[reply_id] = self._stream_result(reply_id, header, frames)

    def _stream_result(self, request_id: int, header: dict,
                       frames: list) -> np.ndarray | DaemonError:
        tokens, hidden = self._stream_pending.pop(request_id)
        if header["op"] == p.ERROR:
            return self._error(header)
        if header["op"] != p.RESULT or len(frames) != 1 or len(frames[0]) != tokens * hidden * 4:
            return DaemonError(p.BAD_FRAME, f"bad result for a [{tokens}, {hidden}] request: "
                                            f"{header}", self.endpoint)
        self.counters.compute_seconds += float(header.get("compute_us", 0.0)) / 1e6
        return np.frombuffer(frames[0], dtype=np.float32).reshape(tokens, hidden)

    def _error(self, header: dict) -> DaemonError:
        return DaemonError(str(header.get("code")), str(header.get("message")), self.endpoint)

    def _raise_if_error(self, header: dict) -> dict:
        if header["op"] == p.ERROR:
            raise self._error(header)
        return header

    def _raise_if_refused(self) -> None:
        """The failure the socket's monitor reports, if any: nothing listens at the endpoint
        (with expect_listening), or the daemon refused the handshake."""
        failure = self._monitor.failure(refused_is_final=self.expect_listening)
        if failure is not None:
            raise failure

    def _forget_session(self) -> None:
        self._drop_shared()
        self._stream_pending.clear()
        self._stream_done.clear()

    def _drop_shared(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None
            self.transport = "stream"


def _what(request) -> str:
    """A request named for messages: an op name, or a compute request's id."""
    return f"compute request {request}" if type(request) is int else request


def _error_text(data: bytes) -> str:
    """"; the daemon says: ..." when an unreadable header is still an error reply."""
    try:
        header = msgpack.unpackb(data)
    except (ValueError, msgpack.UnpackException):
        return ""
    if isinstance(header, dict) and header.get("op") == p.ERROR:
        return f"; the daemon says: {header.get('message')}"
    return ""
