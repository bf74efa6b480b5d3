"""ZeroMQ sockets of the stream transport: the daemon's ROUTER and the parent's DEALER.

Endpoints are `ipc://PATH` or `tcp://HOST:PORT`. Every socket closes with LINGER 0 and has
bounded queues; the daemon refuses frames larger than its batch capacity allows. A ROUTER on a
tcp:// address other hosts can reach must have CURVE keys (moerun.ipc.curve); an ipc://
socket file is private to its owner.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import stat

import zmq

from moerun.ipc.curve import CurveClientKeys, require_keys_if_exposed, set_client_keys
from moerun.ipc.curve_guard import CurveGuard

ENDPOINT = re.compile(r"^(ipc://.+|tcp://[^:/]+:\d+)$")   # what --daemon, --listen and endpoint name
QUEUE_MESSAGES = 1000          # per-peer high-water mark, both ways
SEND_TIMEOUT_MS = 10_000       # a DEALER send blocks at most this long (queue full)
RECONNECT_MS, RECONNECT_MAX_MS = 100, 1000
HEADER_SLACK_BYTES = 1 << 20


def ipc_path(endpoint: str) -> str | None:
    """The filesystem path of an ipc:// endpoint (None for tcp:// or abstract sockets)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    return None if path.startswith("@") else path


def bind_router(context: zmq.Context, endpoint: str, max_frame_bytes: int,
                guard: CurveGuard | None = None) -> zmq.Socket:
    """The daemon's ROUTER, bound, behind the CURVE guard if one is given; an ipc:// socket
    file is private to this user (0600, in a directory made 0700 if it did not exist)."""
    require_keys_if_exposed(endpoint, guard is not None)
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, QUEUE_MESSAGES)
    router.setsockopt(zmq.SNDHWM, QUEUE_MESSAGES)
    router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + HEADER_SLACK_BYTES)
    router.setsockopt(zmq.TCP_KEEPALIVE, 1)
    path = ipc_path(endpoint)
    try:
        if guard is not None:
            guard.protect(context, router)
        if path is None:
            router.bind(endpoint)
        else:
            _remove_stale_socket_file(path)
            old_umask = os.umask(0o077)
            try:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                router.bind(endpoint)
            finally:
                os.umask(old_umask)
            os.chmod(path, 0o600)
    except BaseException:
        router.close(linger=0)
        raise
    return router


def new_dealer(context: zmq.Context, curve: CurveClientKeys | None = None) -> zmq.Socket:
    """The parent's DEALER, a CURVE client when keys are given, not connected yet (a monitor
    attached first sees every event); once connected it reconnects in the background."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, QUEUE_MESSAGES)
    dealer.setsockopt(zmq.SNDHWM, QUEUE_MESSAGES)
    dealer.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    dealer.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
    dealer.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
    dealer.setsockopt(zmq.TCP_KEEPALIVE, 1)
    if curve is not None:
        set_client_keys(dealer, curve)
    return dealer


def receive(socket: zmq.Socket, copied_parts: int, flags: int = 0) -> list:
    """One multipart message: its first `copied_parts` parts as bytes (routing id, header),
    the data frames after them as zero-copy zmq.Frame buffers."""
    parts = [socket.recv(flags)]
    more = socket.getsockopt(zmq.RCVMORE)
    while more:
        parts.append(socket.recv(copy=len(parts) < copied_parts))
        more = socket.getsockopt(zmq.RCVMORE)
    return parts


def remove_socket_file(endpoint: str) -> None:
    path = ipc_path(endpoint)
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _remove_stale_socket_file(path: str) -> None:
    """Unlink a socket file nobody listens on; refuse to steal one that is in use."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)
        return
    except OSError as e:
        raise OSError(f"cannot tell whether ipc://{path} is in use: {e}") from None
    finally:
        probe.close()
    raise OSError(f"another process is listening on ipc://{path}")
