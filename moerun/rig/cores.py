"""This host's CPUs shared between the parent and the CPU daemons that run here: how many
threads each runs, and which cores are its own, so that no core runs two pools of spinning
threads. `split_cpus` is the rule (pure); `share_host` applies it to a rig; `pin_threads` and
`node_cpus` are the Linux calls behind --pin and --numa-node.

Counts given (--threads, a [[daemon]]'s `threads`) are taken as they are; the other processes
share what the given ones leave, equally, a GPU parent taking one core (its CPU fallback) while
CPU daemons need the rest. Each process gets CPUs of its own, in order (a daemon held to a NUMA
node first, from that node), as long as there are enough; --pin holds each process to its CPUs.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from threadpoolctl import ThreadpoolController

from moerun.backends.cpu.library import usable_cpus
from moerun.rig.settings import ConfigError, RigConfig

NODES = Path("/sys/devices/system/node")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    """What one process asks of this host's CPUs."""
    name: str                                # parent, d0, …
    threads: int | None = None               # given; None: a share of what the given ones leave
    light: bool = False                      # one core does, while others share the host (a GPU parent)
    within: frozenset[int] | None = None     # held to these CPUs (a NUMA node's)


@dataclass(frozen=True)
class Share:
    name: str
    threads: int
    cpus: tuple[int, ...]                    # its own CPUs: disjoint from the others' while there are enough
    given: bool = False                      # the count was given, not shared out


def split_cpus(host: Iterable[int], claims: Sequence[Claim]) -> list[Share]:
    """Each claim's threads and CPUs, in the order of `claims`. Counts not given are shared out
    over all of `host` (one held to a node gets at most that node's CPUs); then the claims held
    to a node take their CPUs from it first, and the others take theirs from what is left, in
    order. A claim that finds too few CPUs free takes those there are, then the least shared."""
    host = sorted(set(host))
    pools = [host if claim.within is None else [cpu for cpu in host if cpu in claim.within] for claim in claims]
    for claim, pool in zip(claims, pools):
        if not pool:
            raise ConfigError(f"{claim.name}: none of its NUMA node's CPUs ({format_cpus(claim.within)}) "
                              f"is one this process may run on ({format_cpus(host)})")
    counts = [count if claim.threads is not None else min(count, len(pool))
              for claim, pool, count in zip(claims, pools, _counts(len(host), claims))]
    uses = dict.fromkeys(host, 0)
    cpus: dict[int, tuple[int, ...]] = {}
    for index in sorted(range(len(claims)), key=lambda index: claims[index].within is None):
        mine = sorted(pools[index], key=uses.get)[:counts[index]]       # free ones first, in order
        cpus[index] = tuple(sorted(mine))
        for cpu in mine:
            uses[cpu] += 1
    return [Share(claim.name, count, cpus[index], claim.threads is not None)
            for index, (claim, count) in enumerate(zip(claims, counts))]


def _counts(n_cpus: int, claims: Sequence[Claim]) -> list[int]:
    """Thread counts of claims sharing `n_cpus` CPUs: given ones as given, light ones 1 (unless
    only light ones share), the rest an equal part of what is left (the first ones one more
    where it does not divide), each at least 1."""
    shared = [index for index, claim in enumerate(claims) if claim.threads is None]
    full = [index for index in shared if not claims[index].light] or shared
    left = n_cpus - sum(claim.threads or 0 for claim in claims) - (len(shared) - len(full))
    each, extra = divmod(max(left, 0), max(len(full), 1))
    return [claim.threads if claim.threads is not None
            else max(1, each + (full.index(index) < extra)) if index in full else 1
            for index, claim in enumerate(claims)]


@dataclass
class HostShares:
    """The parent's share and those of this host's CPU daemons, by daemon index."""
    parent: Share
    daemons: dict[int, Share]
    host: tuple[int, ...]                    # the CPUs this process may run on
    pin: bool = False
    _restore: list = field(default_factory=list)

    def describe(self) -> str:
        """One line: who runs how many threads, and where when pinned."""
        listed = ", ".join(f"{share.name} {share.threads}" + (f" on CPUs {format_cpus(share.cpus)}" if self.pin else "")
                           for share in self.shares())
        return f"CPU threads on this host ({len(self.host)} usable CPUs{', pinned' if self.pin else ''}): {listed}"

    def overcommitted(self) -> str | None:
        """A warning when the counts add up to more than the host's CPUs."""
        total = sum(share.threads for share in self.shares())
        if total <= len(self.host):
            return None
        listed = ", ".join(f"{share.name} {share.threads}" for share in self.shares())
        given = [share.name for share in self.shares() if share.given]
        why = (f"the counts given ({', '.join(given)}) add up to more" if given
               else "more processes than CPUs, one thread each")
        return (f"{total} CPU threads ({listed}) on {len(self.host)} usable CPUs: {why}; the processes will compete "
                f"for cores" + (" (give fewer with --threads or `threads =`)" if given else ""))

    def shares(self) -> list[Share]:
        return [self.parent, *self.daemons.values()]

    def spawn_settings(self, index: int) -> dict:
        """spawn_daemon's `threads` and `cpus` for daemon `index`: a CPU daemon's count, and with
        --pin its CPUs (a GPU daemon: all of the host's, rather than the pinned parent's)."""
        share = self.daemons.get(index)
        cpus = (share.cpus if share else self.host) if self.pin else None
        return {"threads": share.threads if share else None, "cpus": cpus}

    def apply_to_parent(self) -> None:
        """Say who got what (when CPU daemons share the host or --pin is given), hold this process
        to its CPUs with --pin, and its BLAS to its thread count; release() undoes both."""
        if self.daemons or self.pin:
            logger.info(self.describe())
        if warning := self.overcommitted():
            logger.warning(warning)
        if self.pin:
            pin_threads(self.parent.cpus)
            self._restore.append(lambda: pin_threads(self.host))
        limit = ThreadpoolController().limit(limits=self.parent.threads, user_api="blas")
        self._restore.append(limit.restore_original_limits)

    def release(self) -> None:
        while self._restore:
            self._restore.pop()()


def share_host(config: RigConfig, host: Iterable[int] | None = None) -> HostShares:
    """The shares of the parent and of the CPU daemons of `config` that run on this host:
    spawned here (--daemon cpu, a [[daemon]] with device "cpu" and no endpoint), or given an
    endpoint on this host (`moerun launch` starts them)."""
    if config.pin and not hasattr(os, "sched_setaffinity"):
        raise ConfigError(f"--pin needs Linux (os.sched_setaffinity); this is {sys.platform}")
    host = tuple(sorted(usable_cpus() if host is None else host))
    claims, indexes = [Claim("parent", config.threads, light=config.device != "cpu")], []
    for index, spec in enumerate(config.daemons):
        entry = config.daemon_entries[index] if config.daemon_entries else None
        if entry is None and spec == "cpu":
            claims.append(Claim(f"d{index}"))
        elif entry is not None and entry.device == "cpu" and entry.runs_here():
            within = None if entry.numa_node is None else node_cpus(entry.numa_node)
            claims.append(Claim(entry.name, entry.threads, within=within))
        else:
            continue
        indexes.append(index)
    parent, *daemons = split_cpus(host, claims)
    return HostShares(parent, dict(zip(indexes, daemons)), host, config.pin)


def pin_threads(cpus: Iterable[int]) -> None:
    """Hold every thread of this process to `cpus`; threads started later inherit it."""
    cpus = set(cpus)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def node_cpus(node: int, nodes: Path = NODES) -> frozenset[int]:
    """NUMA node `node`'s CPUs, from Linux's /sys/devices/system/node/nodeN/cpulist."""
    path = nodes / f"node{node}" / "cpulist"
    try:
        return parse_cpus(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"NUMA node {node}: {path} does not exist (no such node on this machine, "
                          f"or not Linux)") from None


def restrict_to_node(node: int) -> tuple[int, ...]:
    """Hold this process to NUMA node `node`'s CPUs (those of them it may run on); returns them."""
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(f"--numa-node needs Linux (os.sched_setaffinity); this is {sys.platform}")
    allowed = usable_cpus()
    cpus = node_cpus(node)
    mine = tuple(sorted(cpus & allowed))
    if not mine:
        raise ConfigError(f"NUMA node {node}: none of its CPUs ({format_cpus(cpus)}) is one this process may run "
                          f"on ({format_cpus(allowed)})")
    pin_threads(mine)
    return mine


def parse_cpus(text: str) -> frozenset[int]:
    """A Linux CPU list: "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """The other way: {0, 1, 2, 3, 8} -> "0-3,8"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{low}-{high}" if high > low else f"{low}" for low, high in runs)
