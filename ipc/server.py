"""The daemon side of the protocol: a ZeroMQ ROUTER serving one parent session at a time, plus
the slots of the shared arena that parent attached, if any.

The loop never dies on a bad request: every message and every slot gets a reply, an error
reply when it cannot be served. The session owner is the peer that completed HELLO; another
peer's HELLO gets `busy` until the owner has been silent for `lease_s` (or, on this host, its
pid is gone). With CURVE keys only the authorized parents get as far as sending a message.
Shape legend: T tokens, H hidden size, P routed pairs.
"""
from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import zmq

from moerun.ipc import protocol as p
from moerun.ipc import shm
from moerun.ipc.curve import CurveServerKeys
from moerun.ipc.curve_guard import CurveGuard
from moerun.ipc.doorbell import fence
from moerun.ipc.processes import pid_alive
from moerun.ipc.protocol import ProtocolError
from moerun.ipc.shm import STATE_ATTACHED, Arena, ArenaLayout, Slot
from moerun.ipc.sockets import bind_router, receive, remove_socket_file

DAEMON_SPIN_S = 0.0005        # keep spinning on the doorbell this long after the last work
SLEEP_SLICE_S = 0.05          # longest futex sleep; foreign peers are heard at least this often
IDLE_POLL_MS = 100            # ZeroMQ poll slice without an arena (bounds the stop() latency)
CONTROL_WAIT_MS = 5           # wait for a control message the parent announced on the doorbell
SOCKET_CHECK_S = 0.01         # while busy on slots, look at the socket this often

logger = logging.getLogger(__name__)


class Handler(Protocol):
    """What the daemon process implements; all calls come from the serving thread."""

    def info(self) -> dict: ...   # fingerprint, device, backend, model, n_layers, n_experts, hidden

    def assign(self, experts: dict[int, list[int]],
               progress: Callable[[int, int], None]) -> None: ...

    def compute(self, layer: int, x: np.ndarray, counts: np.ndarray, local_ids: np.ndarray,
                weights: np.ndarray) -> np.ndarray: ...  # f32 [T, H] -> f32 [T, H]

    def release(self) -> None: ...

    def stats(self) -> dict: ...

    # A layer shard's step (the daemon started with a layer range): f32 x [T, H] at positions
    # start.. of `sequence` -> f32 [T, H] after its last layer. ValueError when it cannot (an
    # expert daemon, a start that does not continue the sequence it holds).
    def forward(self, sequence: int, start: int, x: np.ndarray) -> np.ndarray: ...

    # The arena a parent attached with transport "shared" or "device" (header: the ATTACH
    # request, for the parent's IPC event handles): the reply fields for ATTACH; for a
    # handler that serves requests in place, a callable: an expert daemon's for padded COMPUTE
    # requests (slot index, layer, dtype, T), a layer shard's for FORWARD requests whose hidden
    # state is in its device buffers (slot index, sequence, start, T) (None: the server hands
    # padded requests to compute() as ragged ones, FORWARD ones to forward()); and for one that
    # serves the arena's requests in a loop of its own, a callable (spin_s, max_s) -> requests
    # served, which returns once the arena was idle for spin_s, its doorbell changed, max_s
    # passed, or a request is left that it does not serve (the server then serves it).
    # Raises ValueError for a transport it cannot serve.
    def attach(self, arena: Arena, transport: str,
               header: dict) -> tuple[dict, Callable | None, Callable | None]: ...


@dataclass
class Session:
    peer: bytes                       # ZeroMQ routing id of the owner
    parent: dict                      # pid, hostname, boot_id from its HELLO
    started: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    ready: bool = False               # an ASSIGN has succeeded
    arena: Arena | None = None
    slot_compute: Callable | None = None   # the handler's in-place compute of padded slot requests
    serve_pending: Callable | None = None  # the handler's own loop over the arena's requests

    def describe(self) -> str:
        return f"parent pid {self.parent['pid']} on {self.parent['hostname']}"

    def parent_gone(self) -> bool:
        """True when the owner ran on this host and its pid no longer exists."""
        me = p.host_identity()
        if not me["boot_id"] or (self.parent["boot_id"], self.parent["hostname"]) != (
                me["boot_id"], me["hostname"]):
            return False
        return not pid_alive(self.parent["pid"])


class Server:
    def __init__(self, endpoint: str, handler: Handler, *, batch_capacity_max: int = p.MAX_BATCH_CAPACITY,
                 lease_s: float = 30.0,
                 spin_s: float = DAEMON_SPIN_S, curve: CurveServerKeys | None = None):
        self.endpoint, self.handler = endpoint, handler
        self.batch_capacity_max, self.lease_s, self.spin_s = batch_capacity_max, lease_s, spin_s
        self.curve = curve
        self.info = dict(handler.info())
        self.hidden = int(self.info["hidden"])
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None
        guard = CurveGuard(curve, logger.info) if curve is not None else None
        try:
            self._socket = bind_router(self._context, endpoint,
                                       batch_capacity_max * self.hidden * 4, guard)
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._session: Session | None = None
        self._stopping = False
        self._control_seen = 0
        self._last_work = 0.0
        self._next_socket_check = 0.0
        self.counts = {"requests": 0, "errors": 0, "sessions": 0}
        self._ops = {p.HELLO: self._hello, p.ASSIGN: self._assign, p.ATTACH: self._attach,
                     p.COMPUTE: self._compute, p.FORWARD: self._forward, p.STATS: self._stats, p.PING: self._ping,
                     p.BYE: self._bye, p.SHUTDOWN: self._shutdown}

    def stop(self) -> None:
        """Ask serve_forever to return; safe from a signal handler."""
        self._stopping = True

    def close(self) -> None:
        """Close the socket and the context (which ends the CURVE guard's thread, that closes
        its own sockets first); never blocks. Safe to call again; serve_forever ends with it."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if not self._context.closed:
            self._context.term()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def serve_forever(self) -> None:
        access = (f"CURVE, {len(self.curve.authorized)} authorized parent keys" if self.curve
                  else "without CURVE")
        logger.info(f"serving {self.endpoint} ({access}): model {self.info.get('model')}, device "
                 f"{self.info.get('device')}, protocol v{p.PROTOCOL_VERSION}")
        try:
            while not self._stopping:
                arena = self._session.arena if self._session else None
                if arena is None:
                    self._serve_stream()
                else:
                    self._serve_shared(arena)
        finally:
            if self._session is not None:
                self._end_session("daemon stopping")
            self.close()
            remove_socket_file(self.endpoint)
            logger.info(f"stopped serving {self.endpoint}")

    def _serve_stream(self) -> None:
        """Without an arena: poll without sleeping for spin_s after the last message (to catch
        back-to-back requests), then sleep in the poll."""
        spinning = time.perf_counter() - self._last_work < self.spin_s
        if self._poller.poll(0 if spinning else IDLE_POLL_MS):
            self._drain_socket(0)
            self._last_work = time.perf_counter()
        elif spinning:
            os.sched_yield()

    # -- the loop with an arena: slots first, the socket when announced or now and then ------

    def _serve_shared(self, arena: Arena) -> None:
        seen = arena.doorbell.value()
        now = time.perf_counter()
        session = self._session
        if session.serve_pending is not None and session.ready and not self._stopping:
            if session.serve_pending(max(0.0, self.spin_s - (now - self._last_work)),
                                     max(0.0, self._next_socket_check - now)):
                session.last_seen = time.monotonic()
                self._last_work = time.perf_counter()
            now = time.perf_counter()
        for index, slot in enumerate(arena.slots):
            if slot.pending() and not self._stopping:
                self._serve_slot(index, slot, arena.layout)
                self._last_work = now = time.perf_counter()
        if arena.control_bell != self._control_seen:
            self._control_seen = arena.control_bell
            self._drain_socket(CONTROL_WAIT_MS)
            self._last_work = now = time.perf_counter()
        elif now >= self._next_socket_check:
            self._drain_socket(0)
            self._next_socket_check = now + SOCKET_CHECK_S
        if self._stopping or self._session is None or self._session.arena is not arena:
            return
        spin_s = self.spin_s - (now - self._last_work)
        if not arena.doorbell.wait(seen, spin_s, SLEEP_SLICE_S, ready=arena.any_pending):
            self._next_socket_check = 0.0

    def _serve_slot(self, index: int, slot: Slot, layout: ArenaLayout) -> None:
        sequence = slot.request_seq
        fence()
        self._session.last_seen = time.monotonic()
        request_id = shm.request_id(slot.buffer)
        forward = shm.request_op(slot.buffer) == shm.OP_FORWARD
        serve = self._serve_forward_slot if forward else self._serve_compute_slot
        try:
            serve(index, slot, layout, request_id)
        except Exception as e:  # noqa: BLE001 - any failure becomes an error reply
            shm.write_error_header(slot.buffer, *self._error_reply(request_id, e))
        fence()
        slot.reply.set(sequence)

    def _serve_compute_slot(self, index: int, slot: Slot, layout: ArenaLayout, request_id: int) -> None:
        """A COMPUTE in slot `index`: the result and its header written there."""
        session = self._session
        layer, dtype, tokens, pairs, padded = shm.read_request_header(slot.buffer, layout)
        self._require_ready()
        if padded and session.slot_compute is not None:
            compute_us = self._run_in_place("compute", session.slot_compute, index, layer, dtype, tokens)
        else:
            request = p.ComputeRequest(layer, *slot.request_frames(dtype, tokens, pairs))
            if padded:
                request = _ragged(request, layout.max_pairs_per_token)
            p.check_counts(request.counts, len(request.local_ids))
            out, compute_us = self._run_compute(request)
            slot.write_result(out)
        shm.write_result_header(slot.buffer, request_id, layer, tokens, layout.hidden, compute_us)

    def _serve_forward_slot(self, index: int, slot: Slot, layout: ArenaLayout, request_id: int) -> None:
        """A layer shard's FORWARD in slot `index`: x [T, H] in, the f32 state after its layers out
        (with transport "device", both in the shard's own device buffers: its in-place call)."""
        sequence, start, dtype, tokens = shm.read_forward_header(slot.buffer, layout)
        if self._session.slot_compute is not None:
            compute_us = self._run_in_place("forward", self._session.slot_compute, index, sequence, start, tokens)
        else:
            out, compute_us = self._run_forward(sequence, start, slot.request_frames(dtype, tokens, 0)[0])
            slot.write_result(out)
        shm.write_result_header(slot.buffer, request_id, 0, tokens, layout.hidden, compute_us)

    # -- the socket ---------------------------------------------------------------------------

    def _drain_socket(self, timeout_ms: int) -> None:
        """Handle every message waiting on the socket, waiting up to timeout_ms for the first."""
        while not self._stopping and self._poller.poll(timeout_ms):
            parts = receive(self._socket, 2)
            self._on_message(parts[0], parts[1:])
            timeout_ms = 0

    def _on_message(self, peer: bytes, parts: list) -> None:
        """parts: the header (bytes), then the data frames."""
        request_id = None
        try:
            if not parts:
                raise ProtocolError(p.BAD_FRAME, "message without a header frame")
            header = p.unpack_header(parts[0], "parent", "daemon")
            request_id = header.get("id")
            if type(request_id) is not int:
                raise ProtocolError(p.BAD_REQUEST, f"request id must be an int, got {request_id!r}")
            op = self._ops.get(header["op"])
            if op is None:
                raise ProtocolError(p.BAD_REQUEST, f"unknown request op {header['op']!r}")
            self.counts["requests"] += 1
            if self._session is not None and peer == self._session.peer:
                self._session.last_seen = time.monotonic()
            op(peer, header, parts[1:])
        except Exception as e:  # noqa: BLE001 - any failure becomes an error reply
            self._send(peer, p.error_header(*self._error_reply(request_id, e)))

    def _send(self, peer: bytes, header: bytes, *frames) -> None:
        try:
            self._socket.send_multipart([peer, header, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # the peer's queue is full or it is gone: drop the reply
            logger.info(f"reply to a peer dropped: {e}")

    def _error_reply(self, request_id, error: Exception) -> tuple:
        """(request id, code, message) of the error reply to a failed request."""
        self.counts["errors"] += 1
        if isinstance(error, ProtocolError):
            request_id = request_id if request_id is not None else error.request_id
            if error.code in (p.VERSION_MISMATCH, p.NO_SESSION):
                logger.warning(f"refused a request ({error.code}): {error.message}")
            return request_id, error.code, error.message
        logger.error(f"internal error on request {request_id!r}: {type(error).__name__}: {error}\n"
                 + "".join(traceback.format_exception(error)).rstrip())
        return request_id, p.INTERNAL, f"{type(error).__name__}: {error}"

    # -- session ----------------------------------------------------------------------------

    def _owned_session(self, peer: bytes) -> Session:
        if self._session is None or self._session.peer != peer:
            current = self._session.describe() if self._session else "no parent"
            raise ProtocolError(p.NO_SESSION, f"no session for this peer (the daemon serves "
                                              f"{current}); send HELLO first")
        return self._session

    def _end_session(self, reason: str) -> None:
        session, self._session = self._session, None
        logger.info(f"session end: {session.describe()} ({reason})")
        if session.arena is not None:
            session.arena.detach()
        try:
            self.handler.release()
        except Exception as e:  # noqa: BLE001 - a session ends even if the handler fails
            logger.warning(f"handler.release failed: {type(e).__name__}: {e}")

    # -- ops ----------------------------------------------------------------------------------

    def _hello(self, peer: bytes, header: dict, frames: list) -> None:
        parent = header.get("parent")
        if (not isinstance(parent, dict) or type(parent.get("pid")) is not int
                or not isinstance(parent.get("hostname"), str)
                or not isinstance(parent.get("boot_id"), str)):
            raise ProtocolError(p.BAD_REQUEST, "hello needs parent {pid, hostname, boot_id}")
        who = f"parent pid {parent['pid']} on {parent['hostname']}"
        ours = self.info.get("fingerprint")
        if header.get("fingerprint") != ours:
            message = p.fingerprint_mismatch(header.get("fingerprint"), str(header.get("model") or ""), ours,
                                             str(self.info.get("model", "")))
            logger.warning(f"refused {who}: {message}")
            raise ProtocolError(p.FINGERPRINT_MISMATCH, message)
        session = self._session
        if session is not None and session.peer != peer:
            silent_s = time.monotonic() - session.last_seen
            if silent_s > self.lease_s:
                self._end_session(f"silent for {silent_s:.1f} s, lease taken over by {who}")
            elif session.parent_gone():
                self._end_session(f"its process is gone, taken over by {who}")
            else:
                since = time.strftime("%H:%M:%S", time.localtime(session.started))
                message = (f"serving {session.describe()} since {since} (last heard {silent_s:.1f} s ago; "
                           f"another parent gets it once that one ends its session or exits, or after "
                           f"{self.lease_s:g} s of silence)")
                logger.warning(f"refused {who} (busy): {message}")
                raise ProtocolError(p.BUSY, message)
        if self._session is None:
            self._session = Session(peer=peer, parent=dict(parent))
            self.counts["sessions"] += 1
            logger.info(f"session start: {who}")
        self._send(peer, p.pack_header(p.HELLO, id=header["id"], **_fields(
            self.info, p.host_identity(), {"batch_capacity_max": self.batch_capacity_max})))

    def _assign(self, peer: bytes, header: dict, frames: list) -> None:
        session = self._owned_session(peer)
        experts = _parse_experts(header.get("experts"), self.info)
        session.ready = False

        def progress(done: int, total: int) -> None:
            self._send(peer, p.pack_header(p.PROGRESS, id=header["id"], done=int(done),
                                           total=int(total)))
        try:
            self.handler.assign(experts, progress)
        except (ValueError, KeyError, IndexError) as e:
            raise ProtocolError(p.BAD_REQUEST, f"assign: {type(e).__name__}: {e}") from None
        session.ready = True
        session.last_seen = time.monotonic()
        total = sum(len(ids) for ids in experts.values())
        logger.info(f"assigned {total} experts over {len(experts)} layers to {session.describe()}")
        self._send(peer, p.pack_header(p.READY, id=header["id"]))

    def _attach(self, peer: bytes, header: dict, frames: list) -> None:
        session = self._owned_session(peer)
        layout = ArenaLayout.from_fields(header, hidden=self.hidden,
                                         batch_capacity_max=self.batch_capacity_max)
        transport = header.get("transport", "shared")
        if transport not in p.ATTACH_TRANSPORTS:
            raise ProtocolError(p.BAD_REQUEST, f"attach: transport must be one of "
                                               f"{', '.join(p.ATTACH_TRANSPORTS)}, got {transport!r}")
        arena = Arena.attach(header.get("name"), layout)
        try:
            fields, slot_compute, serve_pending = self.handler.attach(arena, transport, header)
        except ValueError as e:
            arena.close()
            raise ProtocolError(p.BAD_REQUEST, f"attach: {e}") from None
        except BaseException:
            arena.close()
            raise
        if session.arena is not None:
            session.arena.detach()
        arena.state = STATE_ATTACHED
        session.arena, session.slot_compute, session.serve_pending = arena, slot_compute, serve_pending
        self._control_seen = arena.control_bell
        logger.info(f"attached shared arena {arena.name} ({transport}): {layout.slots} slots of "
                 f"{layout.slot_bytes / 2**20:.1f} MiB for {session.describe()}")
        self._send(peer, p.pack_header(p.ATTACH, id=header["id"], name=arena.name,
                                       **_fields(fields)))

    def _compute(self, peer: bytes, header: dict, frames: list) -> None:
        self._owned_session(peer)
        self._require_ready()
        request = p.parse_compute(header, frames, hidden=self.hidden,
                                  max_tokens=self.batch_capacity_max)
        out, compute_us = self._run_compute(request)
        out = np.ascontiguousarray(out)
        self._send(peer, p.result_header(header["id"], request.layer, *out.shape, compute_us),
                   out)

    def _forward(self, peer: bytes, header: dict, frames: list) -> None:
        self._owned_session(peer)
        request = p.parse_forward(header, frames, hidden=self.hidden, max_tokens=self.batch_capacity_max)
        out, compute_us = self._run_forward(request.sequence, request.start, request.x)
        self._send(peer, p.hidden_header(header["id"], *out.shape, request.dtype, compute_us),
                   p.encode_payload(out, request.dtype))

    def _run_forward(self, sequence: int, start: int, x: np.ndarray) -> tuple[np.ndarray, float]:
        """A layer shard's f32 [T, H] state after its layers, and its time in µs."""
        started = time.perf_counter()
        try:
            out = self.handler.forward(sequence, start, x)
        except ValueError as e:
            raise ProtocolError(p.BAD_REQUEST, f"forward: {e}") from None
        return out, (time.perf_counter() - started) * 1e6

    def _require_ready(self) -> None:
        if not self._session.ready:
            raise ProtocolError(p.NOT_READY, "no experts assigned in this session (send ASSIGN)")

    def _run_compute(self, request: p.ComputeRequest) -> tuple[np.ndarray, float]:
        """The handler's result for a validated request, f32 [T, H], and its time in µs."""
        start = time.perf_counter()
        try:
            out = self.handler.compute(request.layer, request.x, request.counts,
                                       request.local_ids, request.weights)
        except (ValueError, KeyError, IndexError) as e:
            raise ProtocolError(p.BAD_REQUEST, f"compute: {type(e).__name__}: {e}") from None
        compute_us = (time.perf_counter() - start) * 1e6
        out = np.asarray(out, dtype=np.float32)
        if out.shape != request.x.shape:
            raise ProtocolError(p.INTERNAL, f"handler returned shape {out.shape} for "
                                            f"x of shape {request.x.shape}")
        return out, compute_us

    def _run_in_place(self, op: str, slot_compute: Callable, index: int, *request: object) -> float:
        """A request the handler serves from and into its own buffers; its time in µs."""
        start = time.perf_counter()
        try:
            slot_compute(index, *request)
        except (ValueError, KeyError, IndexError) as e:
            raise ProtocolError(p.BAD_REQUEST, f"{op}: {type(e).__name__}: {e}") from None
        return (time.perf_counter() - start) * 1e6

    def _stats(self, peer: bytes, header: dict, frames: list) -> None:
        session = self._session
        server = dict(self.counts, parent=session.parent if session else None,
                      transport="shared" if session and session.arena else "stream")
        self._send(peer, p.pack_header(p.STATS, id=header["id"], **_fields(
            self.handler.stats(), {"server": server})))

    def _ping(self, peer: bytes, header: dict, frames: list) -> None:
        self._send(peer, p.pack_header(p.PONG, id=header["id"]))

    def _bye(self, peer: bytes, header: dict, frames: list) -> None:
        self._owned_session(peer)
        self._end_session("bye")
        self._send(peer, p.pack_header(p.BYE, id=header["id"]))

    def _shutdown(self, peer: bytes, header: dict, frames: list) -> None:
        if self._session is not None:
            self._owned_session(peer)
        logger.info("shutdown requested")
        self._send(peer, p.pack_header(p.BYE, id=header["id"]))
        self.stop()


def _ragged(request: p.ComputeRequest, top_k: int) -> p.ComputeRequest:
    """A padded request (ids and weights [T, K], -1: no expert) in the ragged form."""
    present = request.local_ids >= 0                            # [T·K]
    counts = present.reshape(-1, top_k).sum(axis=1, dtype=np.int32)
    return p.ComputeRequest(request.layer, request.x, counts, request.local_ids[present],
                            request.weights[present])


def _fields(*parts: dict) -> dict:
    """Merge reply fields, leaving out the names every header reserves."""
    merged = {}
    for part in parts:
        merged.update(part)
    return p.own_fields(merged)


def _parse_experts(experts, info: dict) -> dict[int, list[int]]:
    """ASSIGN's {"<layer>": [global expert ids]} as {layer: ids}; raises ProtocolError."""
    if not isinstance(experts, dict):
        raise ProtocolError(p.BAD_REQUEST, "assign needs experts {\"<layer>\": [ids]}")
    n_layers, n_experts = int(info["n_layers"]), int(info["n_experts"])
    parsed = {}
    for key, ids in experts.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()
                and int(key) < n_layers):
            raise ProtocolError(p.BAD_REQUEST, f"assign: layer key {key!r} is not a decimal "
                                               f"string below {n_layers}")
        if (not isinstance(ids, list) or not all(type(e) is int and 0 <= e < n_experts
                                                 for e in ids) or len(set(ids)) != len(ids)):
            raise ProtocolError(p.BAD_REQUEST, f"assign: layer {key} needs distinct expert ids "
                                               f"in [0, {n_experts})")
        parsed[int(key)] = ids
    return parsed
