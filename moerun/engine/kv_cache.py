"""Key/value cache of one sequence, grown in pages as the sequence grows.

Shape legend: S cached positions, NKV key/value heads, D/Dv head dims, T chunk tokens.
"""
from __future__ import annotations

import numpy as np

from moerun.models.spec import ModelSpec

PAGE_TOKENS = 256


class ContextFull(Exception):
    """The sequence would grow past the context the cache was sized for."""


def check_room(needed: int, capacity: int) -> None:
    """ContextFull unless `needed` positions fit in `capacity`."""
    if needed > capacity:
        raise ContextFull(f"the sequence needs {needed} positions but the context holds {capacity}")


class KVCache:
    def __init__(self, spec: ModelSpec, capacity: int):
        self.capacity = capacity
        self.length = 0
        shape_k = (0, spec.n_kv_heads, spec.head_dim_k)
        shape_v = (0, spec.n_kv_heads, spec.head_dim_v)
        self._k = [np.empty(shape_k, np.float32) for _ in range(spec.n_layers)]
        self._v = [np.empty(shape_v, np.float32) for _ in range(spec.n_layers)]

    def reserve(self, n_tokens: int) -> None:
        """Make room for n_tokens more positions, or raise ContextFull."""
        needed = self.length + n_tokens
        check_room(needed, self.capacity)
        allocated = self._k[0].shape[0]
        if needed <= allocated:
            return
        pages = -(-max(needed, 2 * allocated) // PAGE_TOKENS)
        size = min(self.capacity, pages * PAGE_TOKENS)
        self._k = [_grown(a, size) for a in self._k]
        self._v = [_grown(a, size) for a in self._v]

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write k [T, NKV, D], v [T, NKV, Dv] after the current length."""
        end = self.length + k.shape[0]
        self._k[layer][self.length:end] = k
        self._v[layer][self.length:end] = v

    def rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of positions 0..end-1 of one layer: k [S, NKV, D], v [S, NKV, Dv]."""
        return self._k[layer][:end], self._v[layer][:end]

    def advance(self, n_tokens: int) -> None:
        self.length += n_tokens


def _grown(array: np.ndarray, size: int) -> np.ndarray:
    grown = np.empty((size, *array.shape[1:]), np.float32)
    grown[: array.shape[0]] = array
    return grown
