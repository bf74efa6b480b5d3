"""The daemon's door for CURVE: a ZAP handler that admits only authorized parent keys, and a
socket monitor that logs every refused connection with the peer's address and the reason.

A client without CURVE, or with the wrong daemon public key, fails the handshake before ZAP
is asked, so those refusals come from the monitor; a key that is not authorized is refused
by the ZAP handler. Both run in one background thread that lasts as long as the ZeroMQ
context: terminating the context ends it. The monitor reads a peer's address when ZeroMQ
reports the accepted connection; one that hung up before that is "an unknown address".
"""
from __future__ import annotations

import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from moerun.ipc.curve import CurveServerKeys, set_server_keys

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
REPEAT_WINDOW_S = 60.0        # the same refusal from the same host is logged once a minute
UNKNOWN_PEER = "an unknown address"
LOCAL_PEER = re.compile(r"^localhost:(?P<uid>\d+):(?P<gid>\d+):(?P<pid>\d+)$")
PEER_CREDENTIALS = struct.Struct("3i")       # struct ucred: pid, uid, gid
MONITORED = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
             | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
PROTOCOL_REASONS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "the client connected without CURVE (unauthenticated)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "CURVE handshake failed: the client does not have this "
                                          "daemon's public key",
}


class CurveGuard:
    """Admits the parents whose public keys are in `keys.authorized`; logs every refusal."""

    def __init__(self, keys: CurveServerKeys, log: Callable[[str], None]):
        self.keys, self.log = keys, log
        self._peers: dict[int, tuple[str, int | None]] = {}   # accepted socket fd -> (host, port)
        self._failure: str | None = None        # handshake failure awaiting its disconnect
        self._repeats = RepeatFilter(log)

    def protect(self, context: zmq.Context, router: zmq.Socket) -> None:
        """Make `router` a CURVE server behind this guard; call it before binding the socket.
        The guard's sockets belong to its thread from its start; until then, a failure closes them."""
        set_server_keys(router, self.keys)
        sockets = []
        try:
            zap = context.socket(zmq.REP)
            sockets.append(zap)
            zap.linger = 0
            zap.bind(ZAP_ENDPOINT)
            monitor_endpoint = f"inproc://moerun-monitor-{id(router):x}"
            router.monitor(monitor_endpoint, MONITORED)
            events = context.socket(zmq.PAIR)
            sockets.append(events)
            events.linger = 0
            events.connect(monitor_endpoint)
            threading.Thread(target=self._run, args=(zap, events), name="moerun-curve-guard",
                             daemon=True).start()
        except BaseException:
            for made in sockets:
                made.close(linger=0)
            raise

    def _run(self, zap: zmq.Socket, events: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(events, zmq.POLLIN)
        try:
            while True:
                for ready, _ in poller.poll():
                    if ready is zap:
                        self._answer(zap, zap.recv_multipart())
                    else:
                        self._on_event(recv_monitor_message(events))
        except zmq.ContextTerminated:
            pass
        finally:
            zap.close()
            events.close()

    # -- ZAP: is this client key authorized? ------------------------------------------------

    def _answer(self, zap: zmq.Socket, request: list[bytes]) -> None:
        """Reply to one ZAP request; a request that cannot be judged is refused."""
        try:
            status, text = self._judge(request)
        except Exception as e:  # noqa: BLE001 - the handler must answer every request
            status, text = b"500", f"{type(e).__name__}: {e}"
            self.log(f"refused a connection: could not check its key: {text}")
        version, request_id = (request + [b"1.0", b""])[:2]   # defaults for a too-short request
        zap.send_multipart([version, request_id, status, text.encode()[:255], b"", b""])

    def _judge(self, request: list[bytes]) -> tuple[bytes, str]:
        _, _, _, address, _, mechanism, *credentials = request
        host = address.decode()
        if mechanism != b"CURVE" or len(credentials) != 1:
            return self._refuse(host, f"mechanism {mechanism.decode()!r} instead of CURVE")
        key = z85.encode(credentials[0])
        name = self.keys.authorized.get(key)
        if name is None:
            return self._refuse(host, f"its public key {key.decode()} is not among the "
                                      f"authorized keys")
        self.log(f"admitted a connection from {describe_peer(host)} with the authorized key "
                 f"{name!r}")
        return b"200", "OK"

    def _refuse(self, host: str, reason: str) -> tuple[bytes, str]:
        self._repeats.refused(host, None, reason)
        return b"400", reason

    # -- monitor: handshakes that failed before ZAP ------------------------------------------

    def _on_event(self, event: dict) -> None:
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_ACCEPTED:
            self._peers[value] = peer_address(value)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._failure = PROTOCOL_REASONS.get(value, f"ZMTP protocol error {_event_name(value)}")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._failure = (f"the client hung up during the handshake, as a client without "
                             f"CURVE does ({os.strerror(value)})")
        elif kind == zmq.EVENT_DISCONNECTED:
            host, port = self._peers.pop(value, (UNKNOWN_PEER, None))
            if self._failure is not None:
                self._repeats.refused(host, port, self._failure)
                self._failure = None


class RepeatFilter:
    """Logs a refusal, then the same refusal from the same host at most once per window (a
    parent with a wrong key retries every second), saying how many were left out."""

    def __init__(self, log: Callable[[str], None], window_s: float = REPEAT_WINDOW_S):
        self.log, self.window_s = log, window_s
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}   # -> (logged at, left out)

    def refused(self, host: str, port: int | None, reason: str) -> None:
        key = (host, reason)
        now = time.monotonic()
        logged_at, left_out = self._seen.get(key, (-self.window_s, 0))
        if now - logged_at < self.window_s:
            self._seen[key] = (logged_at, left_out + 1)
            return
        again = f" ({left_out} more like it in the last {now - logged_at:.0f} s)" if left_out else ""
        self.log(f"refused a connection from {describe_peer(host, port)}: {reason}{again}")
        self._seen[key] = (now, 0)


def peer_address(fd: int) -> tuple[str, int | None]:
    """(host, port) of the peer of a socket descriptor ZeroMQ accepted; for ipc:// the host is
    "localhost:UID:GID:PID", as ZeroMQ gives it to ZAP."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return UNKNOWN_PEER, None
    try:
        connection = socket.socket(fileno=duplicate)
    except OSError:   # no longer a socket: the connection is gone
        os.close(duplicate)
        return UNKNOWN_PEER, None
    with connection:
        try:
            if connection.family == socket.AF_UNIX:
                pid, uid, gid = PEER_CREDENTIALS.unpack(connection.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size))
                return f"localhost:{uid}:{gid}:{pid}", None
            return connection.getpeername()[:2]
        except OSError:
            return UNKNOWN_PEER, None


def describe_peer(host: str, port: int | None = None) -> str:
    """"10.0.0.5:41234", "[fe80::1]:41234", or "local process 4242 (uid 1000)" for ipc://."""
    local = LOCAL_PEER.match(host)
    if local:
        return f"local process {local['pid']} (uid {local['uid']})"
    host = f"[{host}]" if ":" in host else host
    return host if port is None else f"{host}:{port}"


def _event_name(value: int) -> str:
    try:
        return zmq.Event(value).name
    except ValueError:
        return hex(value)
