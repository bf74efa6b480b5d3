"""One MoE layer's routed experts, split between the parent and the daemons.

`begin` sends every daemon its cold work first (all daemons at once); the caller then
computes the shared expert; `finish` computes the hot experts on the parent, gathers
each daemon's reply and scatter-adds it. A layer whose routed experts are all on the
parent never touches IPC. A daemon that dies, misses its deadline or answers an error is
marked down and its work computed here from the parent's own mmap until it rejoins. Every
request to a daemon is made holding its link's lock, after checking that the link is up and
(for a reply) still in the session the request went out in.

Shape legend: T tokens, H hidden, K experts per token, E experts, P routed pairs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moerun.moe.experts import ExpertStore, moe_ffn
from moerun.moe.placement import PARENT
from moerun.moe.rig import DAEMON_FAILURES, DaemonLink, Rig, failure_reason


@dataclass
class MoEStats:
    moe_layer_calls: int = 0
    hot_only_layer_calls: int = 0      # layers whose routed experts were all on the parent
    routed_pairs: int = 0              # (token, expert) pairs routed
    remote_pairs: int = 0              # of those, sent to a daemon
    fallback_pairs: int = 0            # of those, computed by the parent after a daemon failed

    def to_dict(self) -> dict:
        return {
            "moe_layer_calls": self.moe_layer_calls, "hot_only_layer_calls": self.hot_only_layer_calls,
            "hot_only_layer_share": self.hot_only_layer_calls / self.moe_layer_calls if self.moe_layer_calls else 0.0,
            "routed_pairs": self.routed_pairs, "remote_pairs": self.remote_pairs,
            "remote_pair_share": self.remote_pairs / self.routed_pairs if self.routed_pairs else 0.0,
            "fallback_pairs": self.fallback_pairs,
        }


class LocalMoE:
    """Every expert on the parent (the CPU)."""

    def __init__(self, store: ExpertStore):
        self.store = store
        self.stats = MoEStats()

    def begin(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> "PendingLayer":
        self.stats.moe_layer_calls += 1
        self.stats.hot_only_layer_calls += 1
        self.stats.routed_pairs += ids.size
        return PendingLayer(self, layer, x, ids, weights, hot=None, remote=[])

    def compute(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                mask: np.ndarray | None) -> np.ndarray:
        """The routed pairs `mask` [T, K] selects (all by default), on the host: x [T, H] -> [T, H]"""
        return moe_ffn(x, ids, weights, self.store, layer, mask=mask)


@dataclass
class RemoteWork:
    link: DaemonLink
    mask: np.ndarray                                    # [T, K] pairs this daemon computes
    rows: np.ndarray                                    # [T_d] token rows it was sent
    calls: list[tuple[int, int, int]] = field(default_factory=list)   # (request id, first row, end row)
    session: int | None = None                          # the link's session the calls went out in


class Dispatcher:
    """A CPU parent's MoE step with daemons; `local` (LocalMoE) computes the parent's own
    pairs. A GPU parent splits on the device instead (moerun.backends.gpu_dispatch)."""

    def __init__(self, local, rig: Rig):
        self.local = local
        self.rig = rig
        self.stats = MoEStats()
        self.local_ids = {layer: local_ids(homes) for layer, homes in rig.placement.homes.items()}

    def begin(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> "PendingLayer":
        self.rig.check()
        homes = self.rig.placement.homes[layer][ids]                         # [T, K]
        hot = homes == PARENT
        self.stats.moe_layer_calls += 1
        self.stats.routed_pairs += ids.size
        if hot.all():
            self.stats.hot_only_layer_calls += 1
            return PendingLayer(self.local, layer, x, ids, weights, hot=None, remote=[])
        self.stats.remote_pairs += int((~hot).sum())
        remote = [self._send(self.rig.links[d], homes == d, layer, x, ids, weights) for d in np.unique(homes[~hot])]
        return PendingLayer(self.local, layer, x, ids, weights, hot=hot, remote=remote, dispatcher=self)

    def _send(self, link: DaemonLink, mask: np.ndarray, layer: int, x: np.ndarray, ids: np.ndarray,
              weights: np.ndarray) -> RemoteWork:
        rows = np.flatnonzero(mask.any(axis=1))
        picked = mask[rows]                                                  # [T_d, K]
        counts = picked.sum(axis=1).astype(np.int32)                         # [T_d]
        local = self.local_ids[layer][ids[rows]][picked].astype(np.int32)    # [P_d], token-major
        pair_weights = weights[rows][picked].astype(np.float32)              # [P_d]
        pair_starts = np.concatenate([[0], np.cumsum(counts)])
        work = RemoteWork(link, mask, rows)
        step = self.rig.config.tokens_per_call
        with link.lock:
            if not link.up:              # gather() computes its pairs here
                return work
            work.session = link.session
            try:
                for start in range(0, len(rows), step):
                    end = min(start + step, len(rows))
                    p0, p1 = pair_starts[start], pair_starts[end]
                    request = link.client.submit(layer, x[rows[start:end]], counts[start:end], local[p0:p1],
                                                 pair_weights[p0:p1], self.rig.config.payload_dtype)
                    work.calls.append((request, start, end))
            except DAEMON_FAILURES as err:
                self._fail(link, err)
        return work

    def gather(self, work: RemoteWork, out: np.ndarray, layer: int, x: np.ndarray, ids: np.ndarray,
               weights: np.ndarray) -> None:
        """Add the daemon's replies into out [T, H]; compute its pairs here if it is down or failed."""
        link = work.link
        with link.lock:
            if link.up and link.session == work.session:
                try:
                    parts = [(start, end, link.client.wait(request, self.rig.config.daemon_timeout_s, link.alive))
                             for request, start, end in work.calls]
                    for start, end, part in parts:
                        out[work.rows[start:end]] += part
                    return
                except DAEMON_FAILURES as err:
                    self._fail(link, err)
        link.fallback_calls += 1
        self.stats.fallback_pairs += int(work.mask.sum())
        out += self.local.compute(layer, x, ids, weights, work.mask)

    def _fail(self, link: DaemonLink, err: Exception) -> None:
        """Mark a daemon down (the caller holds its lock); with --require-daemons, stop."""
        self.rig.mark_down(link, failure_reason(err, self.rig.config.daemon_timeout_s))
        self.rig.check()


@dataclass
class PendingLayer:
    local: Any                     # LocalMoE: computes the parent's pairs
    layer: int
    x: np.ndarray                  # [T, H]
    ids: np.ndarray                # [T, K]
    weights: np.ndarray            # [T, K]
    hot: np.ndarray | None         # [T, K] pairs the parent computes; None = all of them
    remote: list[RemoteWork]
    dispatcher: Dispatcher | None = None

    def finish(self) -> np.ndarray:
        """The routed-expert output [T, H]: hot experts here, then each daemon's reply."""
        out = self.local.compute(self.layer, self.x, self.ids, self.weights, self.hot)
        for work in self.remote:
            self.dispatcher.gather(work, out, self.layer, self.x, self.ids, self.weights)
        return out


def local_ids(homes: np.ndarray) -> np.ndarray:
    """[E] global expert id -> its index among the experts of the same daemon."""
    local = np.zeros(len(homes), np.int32)
    for home in np.unique(homes):
        members = np.flatnonzero(homes == home)
        local[members] = np.arange(len(members))
    return local

