"""A GPU parent with expert daemons: each MoE layer's routed pairs split on the device.

A kernel maps the routed ids to the parent's own experts (-1: on a daemon) and counts the
pairs; for every daemon a kernel packs its request (x in the payload dtype, the ids as
that daemon's local ids, -1: not there) straight where its channel wants it
(moerun.rig.gpu.channels), and a host action posts it. The parent's hot experts run
meanwhile on its stream; the finish collects each reply and adds it in. Kernels run in the
graph segments of a captured decode step, the posting and collecting between them; a daemon
behind the pinned arena is rung and awaited there by kernels too (moerun.rig.gpu.rings), so a
step with only such daemons is one graph.
A big prefill chunk may compute the CPU daemons' experts here instead, from copies of their
layers (moerun.rig.gpu.expert_stream), and an expert cache may hold the host-RAM experts routing
favours now beside the hot ones (moerun.rig.gpu.expert_cache); the routing tables say where each
expert is computed at each step (moerun.rig.gpu.routing_tables).
A daemon that fails is marked down and its pairs computed here on the CPU from the mmap
(in a replayed step: the step runs again eagerly, which rewrites the same cache rows).
Its counts stay on the device (a replayed step adds to them too) until counts() reads them.
Shape legend: T tokens, H hidden, K experts per token, E experts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moerun.backends.gpu import BLOCK, GpuExperts, StepRetry, pointer
from moerun.backends.numpy_backend import CpuExperts
from moerun.moe.executor import RemoteCounts
from moerun.moe.placement import PARENT
from moerun.rig.gpu.channels import (
    ArenaChannel,
    GpuAttachments,
    HostChannel,
    RemoteCall,
)
from moerun.rig.gpu.expert_cache import ExpertCache
from moerun.rig.gpu.expert_stream import STREAMED_PAIRS, PrefillStreamer, probe_pair_seconds
from moerun.rig.gpu.host_experts import HostExperts, expert_bytes
from moerun.rig.gpu.host_reads import READ_PAIRS, HostReads, spread
from moerun.rig.gpu.rings import DeviceRings
from moerun.rig.gpu.routing_tables import RoutingTables
from moerun.rig.links import DaemonLink
from moerun.rig.settings import AUTO
from moerun.units import available_host_bytes, format_bytes

REMOTE_PAIRS, REMOTE_LAYERS, HOST_PAIRS, CACHE_HITS = range(4)     # the counters before STREAMED_PAIRS, READ_PAIRS
HOST_SHARE = 0.8           # most of the host's available memory the CPU daemons' experts' second copy may take

logger = logging.getLogger(__name__)


class GpuDispatcher:
    def __init__(self, backend, experts: GpuExperts, rig, gpu: GpuAttachments, fallback: CpuExperts):
        """experts: the parent's own (local ids); fallback: every expert on the CPU (global ids)."""
        self.backend, self.experts, self.rig, self.gpu, self.fallback = backend, experts, rig, gpu, fallback
        cupy, placement = backend.device.cupy, rig.placement
        self.held = {layer: int(np.count_nonzero(homes == PARENT)) for layer, homes in placement.homes.items()}  # hot
        self.host_links = {link.index for link in rig.links if link.client.info.get("device") == "cpu"}
        self.counters = cupy.zeros(READ_PAIRS + 1, cupy.uint64)        # see REMOTE_PAIRS..READ_PAIRS
        self.fallback_pairs = 0
        self._channels: dict[int, Any] = {}
        self.rings = DeviceRings(backend, rig)
        self.cache = self.streamer = self.reads = None
        host = self._host_experts()
        read_in_place = self._read_in_place(host) if host is not None else None
        self.tables = RoutingTables(backend, placement, [link.index for link in rig.links], host, read_in_place)
        if host is not None:
            self._use_host_experts(host, read_in_place)
        backend.device.set_step_hooks(guard=self.rings, before_step=self.cache.before_step if self.cache else None)

    def _use_host_experts(self, host: HostExperts, read_in_place: dict[int, np.ndarray] | None) -> None:
        """Reads in place, the expert cache and prefill streaming, as the rig asks, over `host`."""
        backend, experts, config, cupy = self.backend, self.experts, self.rig.config, self.backend.device.cupy
        if read_in_place:
            self.reads = HostReads(backend, experts, host, self.tables, self.counters)
        if config.expert_cache_bytes > 0:
            self.cache = ExpertCache(backend, experts, host, self.tables, config.expert_cache_bytes)
        if config.stream_tokens is not None:
            threshold = None if config.stream_tokens == AUTO else config.stream_tokens
            pair_seconds = None if threshold is not None else self._probe()
            try:
                self.streamer = PrefillStreamer(backend, experts, host, self.tables, self.counters, threshold,
                                                pair_seconds)
            except cupy.cuda.memory.OutOfMemoryError:
                logger.warning("prefill streaming: no device memory for its two layer buffers; chunks are not "
                               "streamed (leave room, or --stream-threshold off)")

    def _host_experts(self) -> HostExperts | None:
        """The CPU daemons' experts in page-locked memory, when streaming, the cache or reads in
        place want them and the host has the memory for a second copy."""
        config, placement, backend = self.rig.config, self.rig.placement, self.backend
        wanted = config.expert_cache_bytes > 0 or config.stream_tokens is not None or config.read_share is not None
        if not wanted or not self.host_links:
            return None
        homes = {layer: homes for layer, homes in placement.homes.items()
                 if np.isin(homes, list(self.host_links)).any()}
        if not homes:
            return None
        needed = sum(int(np.isin(h, list(self.host_links)).sum()) * expert_bytes(self.rig.gguf, backend.spec, layer)
                     for layer, h in homes.items())
        if needed > HOST_SHARE * available_host_bytes():
            logger.warning(f"the CPU daemons' experts ({format_bytes(needed)}) would not fit twice in this host's "
                           f"available memory: no prefill streaming, expert cache or reads in place")
            return None
        return HostExperts(backend.device.cupy, backend.device.index, self.rig.gguf, backend.spec, homes,
                           self.host_links)

    def _read_in_place(self, host: HostExperts) -> dict[int, np.ndarray]:
        """Per layer, the host experts the GPU reads in place: --gpu-reads SHARE of them."""
        share = self.rig.config.read_share
        if not share:
            return {}
        return {layer: spread(host_layer.ids, share) for layer, host_layer in host.layers.items()}

    def _probe(self) -> float | None:
        rig = self.rig
        return probe_pair_seconds([link for link in rig.links if link.index in self.host_links],
                                  rig.placement.experts_of, self.backend.spec.hidden, self.backend.spec.n_experts_used,
                                  rig.config.expert_payload_dtype, rig.config.daemon_timeout_s)

    def counts(self) -> RemoteCounts:
        counted = [int(n) for n in self.backend.to_host(self.counters)]
        cache, streamer = self.cache, self.streamer
        return RemoteCounts(remote_layer_calls=counted[REMOTE_LAYERS],
                            remote_pairs=counted[REMOTE_PAIRS] - counted[STREAMED_PAIRS] - counted[READ_PAIRS],
                            fallback_pairs=self.fallback_pairs, host_pairs=counted[HOST_PAIRS],
                            cache_hits=counted[CACHE_HITS], streamed_pairs=counted[STREAMED_PAIRS],
                            read_pairs=counted[READ_PAIRS],
                            cache_swaps=cache.swaps if cache else 0, cache_bytes_in=cache.bytes_in if cache else 0,
                            streamed_layers=streamer.layers_streamed if streamer else 0,
                            streamed_bytes=streamer.bytes_streamed if streamer else 0)

    def graph_key(self) -> tuple | None:
        """What a captured step depends on: every link up, in its current session."""
        if not all(link.up for link in self.rig.links):
            return None
        return tuple((link.index, link.session) for link in self.rig.links)

    def begin(self, layer: int, x: Any, ids: Any, weights: Any, residual: Any | None = None) -> "PendingRemote":
        """x [T, H], ids/weights [T, K] on the device: every daemon's request first, then
        the parent's own experts."""
        if self.rig.config.require_daemons:
            self.rig.check()
        backend, cupy = self.backend, self.backend.device.cupy
        n_tokens = ids.shape[0]
        pending = PendingRemote(self, layer, x, ids, weights, residual)
        streamed = self.streamer is not None and self.streamer.streams(layer, n_tokens)
        if streamed:
            self.streamer.prefetch(layer)
        for link in self.rig.links:
            if streamed and link.index in self.host_links:
                continue                          # its experts of this layer are computed here
            channel = self._channel(link)
            if channel is None:
                pending.calls.append(RemoteCall(None, layer, 0, n_tokens, failed=True, link=link))
                continue
            for row0 in range(0, n_tokens, channel.capacity):
                call = RemoteCall(channel, layer, row0, min(channel.capacity, n_tokens - row0), link=link)
                call.slot, outstanding = channel.next_slot()
                if outstanding is not None:       # its slot is needed again: take its reply first
                    self._collect([outstanding], pending.spill(), x, ids, weights)
                self._pack(call, x, ids, weights)
                if backend.device.capturing and self.rings.serves(channel):
                    self.rings.ring(call)
                else:
                    backend.device.cut(lambda call=call: self._post(call))
                pending.calls.append(call)
        parent_ids = cupy.empty_like(ids)
        tables = self.tables.on_device
        host_index = tables["host_index"].get(layer)
        counts = self.cache.routed_counts(layer) if self.cache is not None else None
        backend.device.launch("split_parent_ids", (1,), (BLOCK,), (
            ids, np.int32(ids.size), tables["parent"][layer], parent_ids, self.counters,
            pointer(host_index), np.int32(self.held[layer]), pointer(counts)))
        if self.experts.layers.get(layer) is not None:
            pending.hot = self.experts.compute(layer, x, parent_ids, weights)
        if streamed:
            pending.hot = self.streamer.compute(layer, x, ids, weights, pending.hot)
        elif self.reads is not None and layer in self.reads.layers:
            pending.hot = self.reads.compute(layer, x, ids, weights, pending.hot)
        return pending

    def _channel(self, link: DaemonLink):
        """The link's channel for its current session; None while it is down."""
        if not link.up:
            return None
        channel = self._channels.get(link.index)
        if channel is None or channel.session != link.session:
            attached = self.gpu.attached.get(link.index)
            if link.transport == "stream" or attached is None:
                channel = HostChannel(self.backend, self.rig, link)
            else:
                channel = ArenaChannel(self.backend, self.rig, link, attached)
            self._channels[link.index] = channel
        return channel

    def _pack(self, call: RemoteCall, x: Any, ids: Any, weights: Any) -> None:
        backend, spec = self.backend, self.backend.spec
        x_to, ids_to, weights_to = call.channel.destinations(call)
        backend.device.elementwise("pack_remote", call.tokens * spec.hidden, (
            x, ids, weights, np.int32(call.row0), np.int32(call.tokens), np.int32(spec.hidden),
            np.int32(spec.n_experts_used), self.tables.on_device["daemon"][(call.link.index, call.layer)],
            np.int32(call.channel.payload_code), np.uint64(x_to), np.uint64(ids_to), np.uint64(weights_to)))

    def _post(self, call: RemoteCall) -> None:
        if not call.channel.post(call):
            self._failed()

    def _collect(self, calls: list[RemoteCall], replies: Any, x: Any, ids: Any, weights: Any) -> None:
        """Each call's reply added into replies [T, H] (computed here for a failed one)."""
        on_host = [call for call in calls if not call.failed and not call.on_device]
        if on_host:
            self.backend.device.cut(lambda: self._receive(on_host))
        spec = self.backend.spec
        for call in calls:
            call.done = True
            if call.failed:
                self._fall_back(call, replies, x, ids, weights)
                continue
            if call.on_device:
                self.rings.await_reply(call)
            n = call.tokens * spec.hidden
            self.backend.device.elementwise("add_reply_rows", n, (
                replies, np.uint64(call.channel.reply_address(call)), np.int32(call.row0), np.int32(spec.hidden),
                np.int64(n)))

    def _receive(self, calls: list[RemoteCall]) -> None:
        for call in calls:
            if not call.channel.collect(call):
                self._failed()

    def _failed(self) -> None:
        """A daemon failed (now marked down); inside a recorded step the step starts over."""
        self.rig.check()
        if self.backend.device.graph_step:
            raise StepRetry()

    def _fall_back(self, call: RemoteCall, replies: Any, x: Any, ids: Any, weights: Any) -> None:
        """The call's pairs computed here on the CPU from the mapped file."""
        cupy = self.backend.device.cupy
        rows = slice(call.row0, call.row0 + call.tokens)
        host_ids = self.backend.to_host(ids[rows])
        mask = self.tables.daemon[(call.link.index, call.layer)][host_ids] >= 0          # [T, K]
        self.fallback_pairs += int(mask.sum())
        call.link.fallback_calls += 1
        out = self.fallback.compute(call.layer, self.backend.to_host(x[rows]), np.where(mask, host_ids, -1),
                                    self.backend.to_host(weights[rows]))
        replies[rows] += cupy.asarray(out)


@dataclass
class PendingRemote:
    dispatcher: GpuDispatcher
    layer: int
    x: Any
    ids: Any
    weights: Any
    residual: Any | None           # [T, H] added last
    calls: list[RemoteCall] = field(default_factory=list)
    hot: Any | None = None         # [T, H] the parent's experts; None when it holds none of this layer
    replies: Any | None = None     # [T, H] replies taken early (their slot was needed again)

    def spill(self) -> Any:
        if self.replies is None:
            cupy = self.dispatcher.backend.device.cupy
            self.replies = cupy.zeros((self.ids.shape[0], self.dispatcher.backend.spec.hidden), cupy.float32)
        return self.replies

    def finish(self) -> Any:
        """The routed-expert output [T, H]: the parent's experts plus every daemon's reply,
        added into the parent's output in place, then the residual."""
        backend = self.dispatcher.backend
        out = self.hot if self.hot is not None else self.spill()
        self.dispatcher._collect([call for call in self.calls if not call.done], out, self.x, self.ids, self.weights)
        if self.hot is not None and self.replies is not None:
            out = backend.add(out, self.replies)
        return out if self.residual is None else backend.add(self.residual, out)
