"""A CPU parent's MoE step with expert daemons: each layer's routed experts split between
the parent and the daemons.

`begin` sends every daemon its cold work first (all daemons at once): only the token rows it
needs, with its local expert ids and weights; the forward pass then computes the shared
expert; `finish` computes the parent's own experts, gathers each daemon's reply and
scatter-adds it. A layer whose routed experts are all on the parent never touches IPC. A
daemon that dies, misses its deadline or answers an error is marked down and its pairs
computed here from the parent's own mmap until it rejoins. Every request to a daemon is made
holding its link's lock, after checking that the link is up and (for a reply) still in the
session the request went out in. (A GPU parent splits on the device: gpu/dispatch.py.)

Shape legend: T tokens, H hidden, K experts per token, E experts, P routed pairs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moerun.backends.numpy_backend import CpuExperts
from moerun.moe.executor import RemoteCounts
from moerun.moe.placement import PARENT
from moerun.rig.links import DAEMON_FAILURES, DaemonLink, failure_reason


@dataclass
class RemoteWork:
    link: DaemonLink
    mask: np.ndarray                                    # [T, K] pairs this daemon computes
    rows: np.ndarray                                    # [T_d] token rows it was sent
    calls: list[tuple[int, int, int]] = field(default_factory=list)   # (request id, first row, end row)
    session: int | None = None                          # the link's session the calls went out in


class CpuDispatcher:
    def __init__(self, rig, experts: CpuExperts):
        """rig: the moerun.rig.supervisor.Rig; experts: the parent's own (local ids)."""
        self.rig = rig
        self.experts = experts
        self.fallback = experts.every_expert()
        self.counted = RemoteCounts()
        placement = rig.placement
        self.homes = placement.homes                                       # layer -> [E]
        self.local_ids = {(home, layer): placement.local_ids(layer, home)
                          for layer in self.homes for home in (PARENT, *range(placement.n_daemons))}
        self.tokens_per_call = rig.config.tokens_per_call
        self.payload_dtype = rig.config.expert_payload_dtype
        self.timeout_s = rig.config.daemon_timeout_s
        self.require_daemons = rig.config.require_daemons

    def graph_key(self) -> None:
        return None                       # the numpy backend runs every step as it comes

    def counts(self) -> RemoteCounts:
        return self.counted

    def begin(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
              residual: np.ndarray | None = None) -> PendingLayer:
        if self.require_daemons:
            self.rig.check()
        homes = self.homes[layer][ids]                                       # [T, K]
        hot = homes == PARENT
        parent_ids = np.where(hot, self.local_ids[(PARENT, layer)][ids], -1)
        pending = PendingLayer(self, layer, x, ids, weights, parent_ids, residual)
        if not hot.all():
            self.counted.remote_layer_calls += 1
            self.counted.remote_pairs += int((~hot).sum())
            pending.remote = [self._send(self.rig.links[d], homes == d, layer, x, ids, weights)
                              for d in np.unique(homes[~hot])]
        return pending

    def _send(self, link: DaemonLink, mask: np.ndarray, layer: int, x: np.ndarray, ids: np.ndarray,
              weights: np.ndarray) -> RemoteWork:
        rows = np.flatnonzero(mask.any(axis=1))
        picked = mask[rows]                                                  # [T_d, K]
        counts = picked.sum(axis=1).astype(np.int32)                         # [T_d]
        local = self.local_ids[(link.index, layer)][ids[rows]][picked]      # [P_d], token-major
        pair_weights = weights[rows][picked].astype(np.float32)              # [P_d]
        pair_starts = np.concatenate([[0], np.cumsum(counts)])
        work = RemoteWork(link, mask, rows)
        with link.lock:
            if not link.up:              # gather() computes its pairs here
                return work
            work.session = link.session
            try:
                for start in range(0, len(rows), self.tokens_per_call):
                    end = min(start + self.tokens_per_call, len(rows))
                    p0, p1 = pair_starts[start], pair_starts[end]
                    request = link.client.submit(layer, x[rows[start:end]], counts[start:end], local[p0:p1],
                                                 pair_weights[p0:p1], self.payload_dtype,
                                                 timeout_s=self.timeout_s, alive=link.alive)
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
                    parts = [(start, end, link.client.wait(request, self.timeout_s, link.alive))
                             for request, start, end in work.calls]
                    for start, end, part in parts:
                        out[work.rows[start:end]] += part
                    return
                except DAEMON_FAILURES as err:
                    self._fail(link, err)
        link.fallback_calls += 1
        self.counted.fallback_pairs += int(work.mask.sum())
        out += self.fallback.compute(layer, x, np.where(work.mask, ids, -1), weights)

    def _fail(self, link: DaemonLink, err: Exception) -> None:
        """Mark a daemon down (the caller holds its lock); with --require-daemons, stop."""
        self.rig.mark_down(link, failure_reason(err, self.timeout_s))
        self.rig.check()


@dataclass
class PendingLayer:
    dispatcher: CpuDispatcher
    layer: int
    x: np.ndarray                  # [T, H]
    ids: np.ndarray                # [T, K] global
    weights: np.ndarray            # [T, K]
    parent_ids: np.ndarray         # [T, K] the parent's local ids, -1 where a daemon computes
    residual: np.ndarray | None    # [T, H] added last
    remote: list[RemoteWork] = field(default_factory=list)

    def finish(self) -> np.ndarray:
        """The routed-expert output [T, H]: the parent's experts here, then each daemon's reply,
        then the residual."""
        dispatcher = self.dispatcher
        out = dispatcher.experts.compute(self.layer, self.x, self.parent_ids, self.weights)
        for work in self.remote:
            dispatcher.gather(work, out, self.layer, self.x, self.ids, self.weights)
        return out if self.residual is None else self.residual + out
