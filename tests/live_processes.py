"""Helpers for tests that run real processes: a free TCP port (and endpoint), a server's health, a
process's children, and whether a process has exited."""
from __future__ import annotations

import socket
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
