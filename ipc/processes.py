"""Whether a process still exists (for stale arenas and sockets, and a daemon's owner)."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while a process with this pid exists (ours or another user's) and has not exited:
    a zombie, dead but not yet reaped by its parent, counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True   # no /proc here: existing is all we can tell
