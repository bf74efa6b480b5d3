"""Helpers for tests that run real processes: a free TCP port (and endpoint), a server's health, a
process's children, whether a process has exited, and waiting for a condition."""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tcp_endpoint() -> str:
    """A ZeroMQ endpoint on a free port of 127.0.0.1."""
    return f"tcp://127.0.0.1:{free_port()}"


def healthy(url: str) -> bool:
    """Whether the server at `url` answers /health with 200."""
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def child_pids(pid: int) -> set[int]:
    """The children of process `pid`, zombies included, as /proc lists them per thread."""
    pids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            pids |= {int(child) for child in (task / "children").read_text().split()}
        except FileNotFoundError:       # the thread ended meanwhile
            continue
    return pids


def exited(pid: int) -> bool:
    """No such process, or a zombie nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


REJOIN_TIMEOUT_S = 30.0          # how long a test gives a failed daemon to be back


def live_children() -> set[int]:
    """Processes whose parent is this one, zombies excluded."""
    return {pid for pid in child_pids(os.getpid()) if not exited(pid)}


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` every 20 ms; fail naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.02)
