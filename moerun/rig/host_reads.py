"""Reads in place: a GPU parent multiplies a share of the host-RAM experts itself, its kernels
reading their weights from the page-locked host copy (moerun.rig.host_experts) across the bus —
no device memory, no copy first — in every step that does not stream its layer: decode steps
(inside captured graphs too) and small prefill chunks. The CPU daemons compute the other host
experts' pairs at the same time. The bus and the CPU's own loads are two paths to the same RAM,
each about as fast: a step's host experts split between them take about half as long.

--gpu-reads SHARE of each layer's host experts (spread evenly over it), off, or auto: the share
that makes both paths take as long, from one decode-sized request measured on each at start-up.
Shape legend: T tokens, H hidden, K experts per token, N host experts of a layer.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from moerun.backends.gpu_experts import GpuExperts, layer_experts
from moerun.backends.gpu_kernels import BLOCK
from moerun.rig.host_experts import HostExperts
from moerun.rig.routing_tables import RoutingTables

READ_PAIRS = 5             # the dispatcher's counter of pairs the GPU read in place
TIMED_ROUNDS = 5           # the GPU's timing: the fastest of these counts

logger = logging.getLogger(__name__)


def balanced_share(cpu_seconds: float, gpu_seconds: float) -> float:
    """The share of the host experts the GPU takes so that both paths finish together."""
    return cpu_seconds / (cpu_seconds + gpu_seconds)


def spread(ids: np.ndarray, share: float) -> np.ndarray:
    """round(share · N) of a layer's host expert ids [N], evenly spaced over them."""
    count = round(share * len(ids))
    return ids[(np.arange(count) * len(ids)) // count] if count else ids[:0]


def gpu_pair_seconds(backend, experts: GpuExperts, host: HostExperts) -> float:
    """Seconds per routed pair of a one-token request whose K experts the GPU reads in place."""
    cupy, spec = backend.cupy, backend.spec
    layer = max(host.layers, key=lambda layer: host.layers[layer].nbytes)
    stacks = layer_experts(host.mapped_stacks(layer), spec.expert_ff)
    top_k = min(spec.n_experts_used, stacks.n_experts)
    with backend.stream:
        x = cupy.asarray(np.random.default_rng(0).standard_normal((1, spec.hidden)).astype(np.float32) * 0.1)
        weights = cupy.full((1, spec.n_experts_used), 1.0 / top_k, cupy.float32)
        best = float("inf")
        for turn in range(TIMED_ROUNDS):
            local = (np.arange(spec.n_experts_used) + turn * top_k) % stacks.n_experts
            ids = cupy.asarray(np.where(np.arange(spec.n_experts_used) < top_k, local, -1)[None].astype(np.int32))
            start = backend.stream.record()
            experts.compute_with(stacks, x, ids, weights)
            end = backend.stream.record()
            end.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3 / top_k)
    return best


class HostReads:
    def __init__(self, backend, experts: GpuExperts, host: HostExperts, tables: RoutingTables, counters: Any):
        self.backend, self.experts, self.tables, self.counters = backend, experts, tables, counters
        self.layers = {layer for layer, reads in tables.reads.items() if np.any(reads >= 0)}
        self.stacks = {layer: layer_experts(host.mapped_stacks(layer), backend.spec.expert_ff) for layer in self.layers}

    def compute(self, layer: int, x: Any, ids: Any, weights: Any, hot: Any | None) -> Any:
        """x [T, H], global ids/weights [T, K]: the hot output [T, H] (None: zero) plus the share of
        the layer's host experts read in place."""
        backend, cupy = self.backend, self.backend.cupy
        mapped = cupy.empty_like(ids)
        backend.kernels.launch("map_ids", (1,), (BLOCK,), (ids, np.int32(ids.size), self.tables.on_device["reads"][layer],
                                                      mapped, self.counters[READ_PAIRS:]))
        return self.experts.compute_with(self.stacks[layer], x, mapped, weights, residual=hot)
