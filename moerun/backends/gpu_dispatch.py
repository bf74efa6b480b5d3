"""A GPU parent with expert daemons: each MoE layer's routed pairs split on the device.

A kernel maps the routed ids to the parent's own experts (-1: on a daemon) and counts the
pairs; for every daemon a kernel packs its request (x in the payload dtype, the ids as
that daemon's local ids, -1: not there) straight where its channel wants it
(moerun.backends.gpu_remote), and a host action posts it. The parent's hot experts run
meanwhile on its stream; the finish collects each reply and adds it in. Kernels run in the
graph segments of a captured decode step, the posting and collecting between them.
A daemon that fails is marked down and its pairs computed here on the CPU from the mmap
(in a replayed step: the step runs again eagerly, which rewrites the same cache rows).
Shape legend: T tokens, H hidden, K experts per token, E experts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moerun.backends.gpu_graphs import StepRetry
from moerun.backends.gpu_kernels import BLOCK
from moerun.backends.gpu_moe import GpuExperts
from moerun.backends.gpu_remote import (
    ArenaChannel,
    GpuParent,
    HostChannel,
    RemoteCall,
)
from moerun.moe.dispatch import MoEStats, local_ids
from moerun.moe.experts import ExpertStore, moe_ffn
from moerun.moe.placement import PARENT
from moerun.moe.rig import DaemonLink, Rig


class GpuDispatcher:
    counts_on_host = False        # its stats survive graph replays by themselves

    def __init__(self, backend, experts: GpuExperts, rig: Rig, gpu_parent: GpuParent, store: ExpertStore):
        self.backend, self.experts, self.rig, self.gpu_parent, self.store = backend, experts, rig, gpu_parent, store
        cupy = backend.cupy
        homes = rig.placement.homes
        self.homes = homes
        self.parent_local = {layer: cupy.asarray(_local_ids(row, PARENT)) for layer, row in homes.items()}   # [E]
        self.daemon_local = {(link.index, layer): cupy.asarray(_local_ids(row, link.index))
                             for link in rig.links for layer, row in homes.items()}
        self.counters = cupy.zeros(3, cupy.uint64)    # routed pairs, remote pairs, layer calls with none remote
        self.layer_calls = 0
        self.fallback_pairs = 0
        self._channels: dict[int, Any] = {}

    @property
    def stats(self) -> MoEStats:
        routed, remote, hot_only = (int(n) for n in self.backend.to_host(self.counters))
        return MoEStats(moe_layer_calls=self.layer_calls, hot_only_layer_calls=hot_only, routed_pairs=routed,
                        remote_pairs=remote, fallback_pairs=self.fallback_pairs)

    def graph_key(self) -> tuple | None:
        """What a captured step depends on: every link up, in its current session."""
        if not all(link.up for link in self.rig.links):
            return None
        return tuple((link.index, link.session) for link in self.rig.links)

    def begin(self, layer: int, x: Any, ids: Any, weights: Any) -> "PendingRemote":
        """x [T, H], ids/weights [T, K] on the device: every daemon's request first, then
        the parent's own experts."""
        self.rig.check()
        backend, cupy = self.backend, self.backend.cupy
        n_tokens = ids.shape[0]
        pending = PendingRemote(self, layer, x, ids, weights)
        for link in self.rig.links:
            channel = self._channel(link)
            if channel is None:
                pending.calls.append(RemoteCall(None, layer, 0, n_tokens, failed=True, link=link))
                continue
            for row0 in range(0, n_tokens, channel.capacity):
                call = RemoteCall(channel, layer, row0, min(channel.capacity, n_tokens - row0), link=link,
                                  counts_layer=not any(c.channel for c in pending.calls))
                call.slot, outstanding = channel.next_slot()
                if outstanding is not None:       # its slot is needed again: take its reply first
                    self._collect([outstanding], pending.spill(), x, ids, weights)
                self._pack(call, x, ids, weights)
                backend.cut(lambda call=call: self._post(call))
                pending.calls.append(call)
        if not any(call.counts_layer for call in pending.calls):      # every daemon down: an eager step
            self.layer_calls += 1
        parent_ids = cupy.empty_like(ids)
        backend.kernels["split_parent_ids"]((1,), (BLOCK,), (ids, np.int32(ids.size), self.parent_local[layer],
                                                             parent_ids, self.counters))
        if self.experts.layers.get(layer) is not None:
            pending.hot = self.experts.begin(layer, x, parent_ids, weights).finish()
        return pending

    def _channel(self, link: DaemonLink):
        """The link's channel for its current session; None while it is down."""
        if not link.up:
            return None
        channel = self._channels.get(link.index)
        if channel is None or channel.session != link.session:
            attached = self.gpu_parent.attached.get(link.index)
            if link.transport == "stream" or attached is None:
                channel = HostChannel(self.backend, self.rig, link)
            else:
                channel = ArenaChannel(self.backend, self.rig, link, attached)
            self._channels[link.index] = channel
        return channel

    def _pack(self, call: RemoteCall, x: Any, ids: Any, weights: Any) -> None:
        backend, spec = self.backend, self.backend.spec
        x_to, ids_to, weights_to = call.channel.destinations(call)
        backend.kernels.elementwise("pack_remote", call.tokens * spec.hidden, (
            x, ids, weights, np.int32(call.row0), np.int32(call.tokens), np.int32(spec.hidden),
            np.int32(spec.n_experts_used), self.daemon_local[(call.link.index, call.layer)],
            np.int32(call.channel.payload_code), np.uint64(x_to), np.uint64(ids_to), np.uint64(weights_to)))

    def _post(self, call: RemoteCall) -> None:
        if call.counts_layer:
            self.layer_calls += 1
        if not call.channel.post(call):
            self._failed()

    def _collect(self, calls: list[RemoteCall], replies: Any, x: Any, ids: Any, weights: Any) -> None:
        """Each call's reply added into replies [T, H] (computed here for a failed one)."""
        live = [call for call in calls if not call.failed]
        self.backend.cut(lambda: self._receive(live))
        spec = self.backend.spec
        for call in calls:
            call.done = True
            if call.failed:
                self._fall_back(call, replies, x, ids, weights)
                continue
            n = call.tokens * spec.hidden
            self.backend.kernels.elementwise("add_reply_rows", n, (
                replies, np.uint64(call.channel.reply_address(call)), np.int32(call.row0), np.int32(spec.hidden),
                np.int64(n)))

    def _receive(self, calls: list[RemoteCall]) -> None:
        for call in calls:
            if not call.channel.collect(call):
                self._failed()

    def _failed(self) -> None:
        """A daemon failed (now marked down); inside a recorded step the step starts over."""
        self.rig.check()
        if self.backend.graph_step:
            raise StepRetry()

    def _fall_back(self, call: RemoteCall, replies: Any, x: Any, ids: Any, weights: Any) -> None:
        """The call's pairs computed here on the CPU from the mapped file."""
        cupy = self.backend.cupy
        rows = slice(call.row0, call.row0 + call.tokens)
        host_ids = self.backend.to_host(ids[rows])
        mask = self.homes[call.layer][host_ids] == call.link.index                     # [T, K]
        self.fallback_pairs += int(mask.sum())
        call.link.fallback_calls += 1
        out = moe_ffn(self.backend.to_host(x[rows]), host_ids, self.backend.to_host(weights[rows]), self.store,
                      call.layer, mask)
        replies[rows] += cupy.asarray(out)


@dataclass
class PendingRemote:
    dispatcher: GpuDispatcher
    layer: int
    x: Any
    ids: Any
    weights: Any
    calls: list[RemoteCall] = field(default_factory=list)
    hot: Any | None = None         # [T, H] the parent's experts; None when it holds none of this layer
    replies: Any | None = None     # [T, H] replies taken early (their slot was needed again)

    def spill(self) -> Any:
        if self.replies is None:
            cupy = self.dispatcher.backend.cupy
            self.replies = cupy.zeros((self.ids.shape[0], self.dispatcher.backend.spec.hidden), cupy.float32)
        return self.replies

    def finish(self) -> Any:
        """The routed-expert output [T, H]: the parent's experts plus every daemon's reply,
        added into the parent's output in place."""
        out = self.hot if self.hot is not None else self.spill()
        self.dispatcher._collect([call for call in self.calls if not call.done], out, self.x, self.ids, self.weights)
        if self.hot is not None and self.replies is not None:
            out = self.dispatcher.backend.add(out, self.replies)
        return out


def _local_ids(homes: np.ndarray, home: int) -> np.ndarray:
    """[E] global expert id -> its index among the experts at `home`, -1 elsewhere."""
    return np.where(homes == home, local_ids(homes), -1).astype(np.int32)
