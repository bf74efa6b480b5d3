"""Reads in place: a GPU parent multiplies a share of the host-RAM experts itself, its kernels
reading their weights from the page-locked host copy (moerun.rig.gpu.host_experts) across the bus —
no device memory, no copy first — in every step that does not stream its layer: decode steps
(inside captured graphs too) and small prefill chunks. The CPU daemons compute the other host
experts' pairs at the same time. Both paths read the same RAM: this gains where the CPU daemons
are bound by their compute rather than by the memory's bandwidth (few cores), and costs where
they already use the bandwidth (docs/benchmarks.md has a 16-core machine's figures), so it is off
unless asked for.

--gpu-reads SHARE of each layer's host experts, spread evenly over it (default off).
Shape legend: T tokens, H hidden, K experts per token, N host experts of a layer.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from moerun.backends.gpu import GpuExperts, layer_experts
from moerun.rig.gpu.host_experts import HostExperts
from moerun.rig.gpu.routing_tables import RoutingTables

READ_PAIRS = 5             # the dispatcher's counter of pairs the GPU read in place


def spread(ids: np.ndarray, share: float) -> np.ndarray:
    """round(share · N) of a layer's host expert ids [N], evenly spaced over them."""
    count = round(share * len(ids))
    return ids[(np.arange(count) * len(ids)) // count] if count else ids[:0]


class HostReads:
    def __init__(self, backend, experts: GpuExperts, host: HostExperts, tables: RoutingTables, counters: Any):
        self.experts, self.tables, self.counters = experts, tables, counters
        self.layers = {layer for layer, reads in tables.reads.items() if np.any(reads >= 0)}
        self.stacks = {layer: layer_experts(host.mapped_stacks(layer), backend.spec.expert_ff) for layer in self.layers}

    def compute(self, layer: int, x: Any, ids: Any, weights: Any, hot: Any | None) -> Any:
        """x [T, H], global ids/weights [T, K]: the hot output [T, H] (None: zero) plus the share of
        the layer's host experts read in place."""
        return self.experts.compute_through(self.stacks[layer], self.tables.on_device["reads"][layer],
                                            self.counters[READ_PAIRS:], x, ids, weights, hot)
