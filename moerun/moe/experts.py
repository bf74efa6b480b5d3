"""Routed experts on the reference backend: a byte-bounded cache of dequantized
experts read straight from the GGUF mmap, and the grouped expert FFN.

Shape legend: T tokens, H hidden size, F expert FFN width, E experts, K experts per token.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from moerun.backends.numpy_ops import swiglu_ffn
from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec

ExpertWeights = tuple[np.ndarray, np.ndarray, np.ndarray]  # gate [F, H], up [F, H], down [H, F]


class ExpertStore:
    """Dequantizes one expert at a time on first use; keeps the most recently
    used ones while they fit in `cache_bytes` of float32."""

    def __init__(self, gguf: GGUFFile, spec: ModelSpec, cache_bytes: int):
        self.gguf = gguf
        self.spec = spec
        self.cache_bytes = cache_bytes
        self.expert_bytes = 3 * spec.expert_ff * spec.hidden * 4
        self._cache: OrderedDict[tuple[int, int], ExpertWeights] = OrderedDict()
        for layer in self.moe_layer_ids:
            for name in expert_tensor_names(spec, layer):
                gguf.tensor(name)  # fail at load, not mid-generation, if one is missing

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, is_moe in enumerate(self.spec.moe_layers) if is_moe]

    def get(self, layer: int, expert: int) -> ExpertWeights:
        key = (layer, expert)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        weights = load_expert(self.gguf, self.spec, layer, expert)
        self._cache[key] = weights
        while len(self._cache) * self.expert_bytes > self.cache_bytes and len(self._cache) > 1:
            self._cache.popitem(last=False)
        return weights



def expert_tensor_names(spec: ModelSpec, layer: int) -> list[str]:
    parts = ("gate_up", "down") if spec.fused_gate_up else ("gate", "up", "down")
    return [f"blk.{layer}.ffn_{p}_exps.weight" for p in parts]


def load_expert(gguf: GGUFFile, spec: ModelSpec, layer: int, expert: int) -> ExpertWeights:
    """One expert dequantized to float32 from the mmap, without touching the others."""
    mats = [gguf.dequantize_expert(name, expert) for name in expert_tensor_names(spec, layer)]
    if spec.fused_gate_up:
        gate_up, down = mats                           # gate_up [2F, H], gate first
        return gate_up[: spec.expert_ff], gate_up[spec.expert_ff:], down
    gate, up, down = mats
    return gate, up, down


def moe_ffn(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, store: ExpertStore, layer: int,
            mask: np.ndarray | None = None) -> np.ndarray:
    """out[t] = Σ_k weights[t, k] · FFN_{ids[t, k]}(x[t]) over the pairs `mask` [T, K]
    selects (all by default).  x [T, H], ids/weights [T, K] -> [T, H]"""
    rows, slots = np.nonzero(mask if mask is not None else np.ones(ids.shape, bool))
    return grouped_ffn(x, rows, ids[rows, slots], weights[rows, slots], lambda e: store.get(layer, e))


def grouped_ffn(x: np.ndarray, rows: np.ndarray, experts: np.ndarray, weights: np.ndarray,
                expert: Callable[[int], ExpertWeights]) -> np.ndarray:
    """Routed pairs grouped by expert: out[rows[p]] += weights[p] · FFN_{experts[p]}(x[rows[p]]).
    x [T, H]; rows, experts, weights [P] with each (row, expert) at most once -> [T, H]"""
    out = np.zeros_like(x)
    for e in np.unique(experts):
        pick = experts == e
        token_rows = rows[pick]
        out[token_rows] += swiglu_ffn(x[token_rows], *expert(int(e))) * weights[pick][:, None]
    return out
