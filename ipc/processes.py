"""Whether a process still exists (for stale arenas and sockets, and a daemon's owner)."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while a process with this pid exists (ours or another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by someone else
    return True
