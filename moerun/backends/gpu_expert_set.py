"""A GPU expert daemon's compute: the experts a parent assigns, copied from the mapped
file into per-layer stacks on the device (index = daemon-local id), run with the
parent's own expert kernels.

Shape legend: T tokens, H hidden, P routed pairs, W the most pairs of one token.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moerun.backends import open_backend
from moerun.backends.gpu_moe import GpuExperts, load_experts
from moerun.backends.gpu_weights import Uploader
from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec


class GpuExpertSet:
    def __init__(self, device: str, gguf: GGUFFile, spec: ModelSpec):
        self.backend = open_backend(device, spec)
        self.gguf = gguf
        self.spec = spec
        self.experts = GpuExperts(self.backend, spec, {})

    def load(self, assignment: dict[int, list[int]], progress: Callable[[int, int], None]) -> None:
        """Replace the resident experts with `assignment` (global ids per layer)."""
        self.experts.layers = {}
        uploader = Uploader(self.backend.cupy, self.gguf, lambda nbytes: None)
        total, done = sum(len(ids) for ids in assignment.values()), 0
        layers = {}
        for layer, ids in sorted(assignment.items()):
            layers[layer] = load_experts(uploader, self.spec, layer, ids)
            done += len(ids)
            progress(done, total)
        uploader.finish()
        self.experts.layers = layers

    def compute(self, layer: int, x: np.ndarray, counts: np.ndarray, local_ids: np.ndarray,
                weights: np.ndarray) -> np.ndarray:
        """out[t] = Σ weights · FFN(x[t]) over token t's local experts. x [T, H] -> [T, H]"""
        n_tokens = len(counts)
        width = max(int(counts.max()) if n_tokens else 0, 1)
        slot = np.arange(local_ids.size) - np.repeat(np.cumsum(counts) - counts, counts)
        rows = np.repeat(np.arange(n_tokens), counts)
        ids = np.full((n_tokens, width), -1, np.int32)                  # [T, W], -1: no expert
        padded_weights = np.zeros((n_tokens, width), np.float32)
        ids[rows, slot], padded_weights[rows, slot] = local_ids, weights
        backend, cupy = self.backend, self.backend.cupy
        with backend.stream:
            pending = self.experts.begin(layer, cupy.asarray(np.ascontiguousarray(x, np.float32)),
                                         cupy.asarray(ids), cupy.asarray(padded_weights))
            return backend.to_host(pending.finish())

    def release(self) -> None:
        self.experts.layers = {}
