"""A daemon as the parent sees it: its client, its process when spawned here, whether it is up,
and how a failure is told.

Threads: the generation thread talks to a daemon only while it holds the link's lock and
sees the link up. The link's watcher thread (moerun.rig.supervisor) takes the same lock for
a heartbeat and to switch a rejoined daemon back in; while a link is down its client belongs
to the watcher alone.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from moerun.errors import MoerunError
from moerun.ipc.client import DaemonClient
from moerun.ipc.protocol import DaemonDied, DaemonError, DaemonTimeout, DaemonUnreachable
from moerun.rig.spawn import LocalDaemon

DAEMON_FAILURES = (DaemonTimeout, DaemonDied, DaemonError, OSError)


class RigError(MoerunError, RuntimeError):
    """The rig cannot run as asked (a daemon failed to start, a required daemon failed)."""


@dataclass
class DaemonLink:
    index: int
    spec: str
    client: DaemonClient
    local: LocalDaemon | None
    label: str = ""                         # its [[daemon]] table's name; "": d<index>
    transport: str = "stream"               # chosen at the handshake
    lock: threading.Lock = field(default_factory=threading.Lock)    # one thread talks to the daemon at a time
    wake: threading.Event = field(default_factory=threading.Event)  # rouses the watcher early
    up: bool = True                         # requests go to it; set with down_reason, under `lock`
    down_reason: str | None = None          # why it is down
    down_since: float = 0.0
    session: int = 0                        # bumped by every rejoin: requests of an older session are void
    times_down: int = 0
    restarts: int = 0                       # processes started to replace this one (spawned daemons)
    rejoins: int = 0
    fallback_calls: int = 0                 # layer calls whose work for it the parent computed instead

    def __post_init__(self) -> None:
        self.label = self.label or f"d{self.index}"

    @property
    def name(self) -> str:
        """How messages and the stats name it: "gpu1 cuda:1", "d0 cpu"."""
        return f"{self.label} {self.spec}"

    def alive(self) -> bool:
        return self.local.alive() if self.local else True


def failure_reason(err: Exception, timeout_s: float, when: str = "") -> str:
    """How a daemon failed, for the log and the stats: "died", "did not answer within 30 s",
    "is unreachable: no socket file at ..."; `when` ("at start") follows the verb."""
    when = f" {when}" if when else ""
    if isinstance(err, DaemonUnreachable):
        return f"is unreachable{when}: {err.reason}"
    if isinstance(err, DaemonTimeout):
        return f"did not answer within {timeout_s:g} s{when}"
    if isinstance(err, DaemonDied):
        return f"died{when}"
    return f"failed{when}: {err}"
