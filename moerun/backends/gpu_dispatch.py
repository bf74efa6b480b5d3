"""A GPU parent with expert daemons (staged through host memory).

A per-layer mask of the experts resident on the parent, kept on the device, decides
without moving the activations whether a layer's routed experts are all here: then
the GPU experts run as in an all-local step. Otherwise the activations, ids and
weights come to the host and the Dispatcher sends each daemon its work; the parent's
own share runs on the GPU experts meanwhile, and the sum goes back to the device.
Shape legend: T tokens, H hidden, K experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moerun.backends.gpu_moe import GpuExperts
from moerun.moe.dispatch import Dispatcher, PendingLayer
from moerun.moe.placement import PARENT


class GpuDispatcher:
    def __init__(self, backend, dispatcher: Dispatcher):
        self.backend = backend
        self.dispatcher = dispatcher
        self.experts: GpuExperts = dispatcher.local
        self.stats = dispatcher.stats
        cupy = backend.cupy
        self.resident = {layer: cupy.asarray((homes == PARENT).astype(np.int32))     # [E] per layer
                         for layer, homes in dispatcher.rig.placement.homes.items()}

    def begin(self, layer: int, x: Any, ids: Any, weights: Any):
        """x [T, H], ids/weights [T, K] on the device."""
        backend, cupy = self.backend, self.backend.cupy
        remote = cupy.zeros(1, cupy.int32)
        backend.kernels.elementwise("any_remote", ids.size, (ids, np.int32(ids.size), self.resident[layer], remote))
        if not int(backend.to_host(remote)[0]):
            self.dispatcher.rig.check()
            self.stats.moe_layer_calls += 1
            self.stats.hot_only_layer_calls += 1
            self.stats.routed_pairs += ids.size
            return self.experts.begin(layer, x, ids, weights)
        pending = self.dispatcher.begin(layer, backend.to_host(x), backend.to_host(ids), backend.to_host(weights))
        return BackOnDevice(pending, cupy)


@dataclass
class BackOnDevice:
    pending: PendingLayer
    cupy: Any

    def finish(self) -> Any:
        return self.cupy.asarray(self.pending.finish())
