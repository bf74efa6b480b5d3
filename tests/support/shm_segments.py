"""The moerun arenas in /dev/shm that belong to this test run: the segments (moerun-<pid>-<hex>)
made by this process or a process below it, and those whose maker is gone (a parent that leaked
its arena and exited). A live moerun beside the run (another user, a second copy of the suite)
owns its own segments, and is never taken for a leak of ours."""
from __future__ import annotations

import os
from pathlib import Path

from moerun.ipc.shm import NAME_PATTERN

SHM_DIR = Path("/dev/shm")


def shm_segments() -> set[str]:
    return {path.name for path in SHM_DIR.glob("moerun-*") if _ours(path.name)}


def _ours(name: str) -> bool:
    match = NAME_PATTERN.fullmatch(name)
    if match is None:
        return True                        # not an arena moerun names: counted, to be looked at
    pid = int(match.group(1))
    return not Path(f"/proc/{pid}").exists() or _descends_from_us(pid)


def _descends_from_us(pid: int) -> bool:
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:                    # it exited meanwhile
            return True
        pid = int(stat.rpartition(")")[2].split()[1])     # field 4, after the command's name in parentheses
    return False
