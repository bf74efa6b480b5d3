"""Prefill streaming: for a big enough prefill chunk a GPU parent computes the experts in host
RAM itself instead of sending the chunk's tokens to the CPU daemons. A layer's host experts
(moerun.rig.gpu.host_experts) are copied into one of two device buffers on a copy stream, the next
layer's while this one computes, and multiplied like the hot ones (every token that chose an
expert against that expert's copy, tile by tile); the CPU daemons get no call for that layer.
The experts the expert cache holds are computed from the cache and not copied. A copied expert
stays valid in its buffer (the bytes never change): the next chunk's first layer is copied at
the end of this one's, and a layer already in a buffer gets only the experts it lacks (one the
cache gave back since). No kernel reads an expert's place before its copy: a computation reads
only the experts the tables stream at its step, all copied by then.

A layer streams when the chunk has at least its threshold of tokens: --stream-threshold N for
every layer, or (auto) the token count at which copying the layer's host experts takes as long
as the CPU daemons would take for the chunk — from the copy's bandwidth, measured once, and
the CPU daemons' time per routed pair, measured once by a probe request to each.
Shape legend: T tokens, H hidden, K experts per token, E experts, N host experts of a layer.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from moerun.backends.gpu import GpuExperts, layer_experts
from moerun.ipc.protocol import DaemonDied, DaemonError, DaemonTimeout
from moerun.rig.gpu.host_experts import HostExperts
from moerun.rig.gpu.routing_tables import RoutingTables
from moerun.rig.links import DaemonLink

PROBE_TOKENS = 64          # tokens of the probe request to a CPU daemon
PROBE_ROUNDS = 5           # the first ones pay the daemon's page faults: the fastest counts
STREAMED_PAIRS = 4         # the dispatcher's counter of pairs computed from a streamed layer

logger = logging.getLogger(__name__)


def auto_threshold(copy_seconds: float, token_seconds: float) -> int:
    """The fewest tokens for which the CPU daemons' time (token_seconds each) reaches the copy's."""
    return max(2, math.ceil(copy_seconds / token_seconds))


def probe_pair_seconds(links: list[DaemonLink], experts_of, hidden: int, top_k: int, dtype: str,
                       timeout_s: float) -> float | None:
    """The CPU daemons' seconds per routed pair of a prefill-sized request, round trip (the
    fastest daemon's, divided among them: they compute at once); None when none answered."""
    tokens = PROBE_TOKENS
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((tokens, hidden)) * 0.1).astype(np.float32)
    best = []
    for link in links:
        held = experts_of(link.index)
        if not held or not link.up:
            continue
        layer, ids = min(held.items())
        k = min(top_k, len(ids))
        local = (np.arange(tokens * k) % len(ids)).astype(np.int32)
        counts = np.full(tokens, k, np.int32)
        weights = np.full(tokens * k, 1.0 / k, np.float32)
        times = []
        try:
            with link.lock:
                for _ in range(PROBE_ROUNDS):
                    started = time.perf_counter()
                    request = link.client.submit(layer, x, counts, local, weights, dtype)
                    link.client.wait(request, timeout_s, link.alive)
                    times.append(time.perf_counter() - started)
        except (DaemonTimeout, DaemonDied, DaemonError, OSError) as err:
            logger.warning(f"daemon {link.name}: no answer to the probe request ({err}); it is left out")
            continue
        best.append(min(times) / (tokens * k))
    return min(best) / len(best) if best else None


class PrefillStreamer:
    def __init__(self, backend, experts: GpuExperts, host: HostExperts, tables: RoutingTables, counters: Any,
                 threshold: int | None, pair_seconds: float | None):
        """threshold: tokens for every layer (None: auto, from pair_seconds; without it, never)."""
        cupy = backend.device.cupy
        self.backend, self.experts, self.host, self.tables, self.counters = backend, experts, host, tables, counters
        self.order = sorted(host.layers)
        widths = [max(layer.stacks[i].data.nbytes for layer in host.layers.values())
                  for i in range(len(host.layers[self.order[0]].stacks))]
        self._buffers = [[cupy.empty(width, cupy.uint8) for width in widths] for _ in range(2)]
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        self._holds: list[int | None] = [None, None]      # the layer each buffer holds (copied or being copied)
        self._copied: list[Any] = [None, None]            # event: the buffer's copy is done
        self._free: list[Any] = [None, None]              # event: the last compute that read it is done
        self._present: list[np.ndarray | None] = [None, None]   # [N]: the host experts copied into it
        self.layers_streamed = 0
        self.bytes_streamed = 0
        bandwidth = self._measure()
        self.tokens = {layer: threshold for layer in self.order}
        if threshold is None:
            self.tokens = self._auto(bandwidth, pair_seconds)

    def _measure(self) -> float:
        """Bytes per second of copying the largest layer whole (twice; the second counts); it stays copied."""
        cupy = self.backend.device.cupy
        layer = max(self.order, key=lambda layer: self.host.layers[layer].nbytes)
        every = np.ones(len(self.host.layers[layer].ids), bool)
        for _ in range(2):
            start = self.copy_stream.record()
            copied = self.host.copy_experts(layer, every, self._buffers[0], self.copy_stream)
            end = self.copy_stream.record()
            end.synchronize()
        self._holds[0], self._copied[0], self._present[0] = layer, end, every
        return copied / (cupy.cuda.get_elapsed_time(start, end) / 1e3)

    def _auto(self, bandwidth: float, pair_seconds: float | None) -> dict[int, int | None]:
        spec = self.backend.spec
        if pair_seconds is None:
            logger.warning("prefill streaming: no CPU daemon answered the probe; chunks are not streamed")
            return {layer: None for layer in self.order}
        tokens = {}
        for layer in self.order:
            host_layer = self.host.layers[layer]
            token_seconds = pair_seconds * spec.n_experts_used * len(host_layer.ids) / spec.n_experts
            tokens[layer] = auto_threshold(host_layer.nbytes / bandwidth, token_seconds)
        typical = sorted(tokens.values())[len(tokens) // 2]
        logger.info(f"prefill streaming: host experts copied at {bandwidth / 1e9:.1f} GB/s; the CPU daemons take "
                    f"{pair_seconds * 1e6:.1f} us a routed pair: a layer streams from {typical} tokens a chunk "
                    f"(the median over {len(tokens)} layers; --stream-threshold N sets it)")
        return tokens

    def streams(self, layer: int, n_tokens: int) -> bool:
        """Whether this chunk's `layer` computes its host experts from a copy (never in a decode step
        being captured or replayed)."""
        threshold = self.tokens.get(layer)
        return threshold is not None and n_tokens >= threshold and not self.backend.device.graph_step

    def prefetch(self, layer: int) -> None:
        """`layer` and the next host layer (the first after the last) copied or being copied."""
        self._copy(layer, keep=None)
        following = self.order[(self.order.index(layer) + 1) % len(self.order)]
        if following != layer:
            self._copy(following, keep=layer)

    def _copy(self, layer: int, keep: int | None) -> None:
        """Queue the copies of `layer`'s streamed experts its buffer lacks (a buffer not holding
        `layer` is taken over once the last computation that read it is done)."""
        streamed = self.tables.streamed[layer]                          # [E] -> host index, -1: not streamed
        wanted = np.zeros(len(self.host.layers[layer].ids), bool)      # [N]
        wanted[streamed[streamed >= 0]] = True
        if layer in self._holds:
            buffer = self._holds.index(layer)
            missing = wanted & ~self._present[buffer]
            if not missing.any():
                return
        else:                               # its event is recorded even with nothing to copy (all cached)
            buffer = 1 if self._holds[0] == keep else 0
            if self._free[buffer] is not None:
                self.copy_stream.wait_event(self._free[buffer])
            self._holds[buffer], self._present[buffer] = layer, np.zeros_like(wanted)
            missing = wanted
        self.bytes_streamed += self.host.copy_experts(layer, missing, self._buffers[buffer], self.copy_stream)
        self._present[buffer] |= missing
        self._copied[buffer] = self.copy_stream.record()

    def compute(self, layer: int, x: Any, ids: Any, weights: Any, hot: Any | None) -> Any:
        """x [T, H], global ids/weights [T, K]: the hot output [T, H] (None: zero) plus the layer's
        streamed experts' share, queued on the backend's stream after the layer's copy."""
        backend = self.backend
        buffer = self._holds.index(layer)
        backend.device.stream.wait_event(self._copied[buffer])
        stacks = layer_experts(self.host.device_stacks(layer, self._buffers[buffer]), backend.spec.expert_ff)
        out = self.experts.compute_through(stacks, self.tables.on_device["streamed"][layer],
                                           self.counters[STREAMED_PAIRS:], x, ids, weights, hot)
        self._free[buffer] = backend.device.stream.record()
        self.layers_streamed += 1
        return out
