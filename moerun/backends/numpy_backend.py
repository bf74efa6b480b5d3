"""The reference backend: every operation in float32 numpy on the CPU (the math is in
numpy_ops).

Weights are dequantized at load, the embedding rows on use; the routed experts one at a
time on first use, straight from the mmap, into a byte-bounded cache. The KV cache grows in
pages as the sequence does.
Shape legend: T tokens, H hidden, N output rows, NH/NKV heads, D/Dv head dims,
E experts, K experts per token, F expert FFN width, S cached positions.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from moerun.backends.numpy_ops import (
    ExpertWeights,
    apply_rope,
    causal_attention,
    grouped_ffn,
    rms_norm,
    rope_tables,
    route,
    sigmoid,
    silu,
)
from moerun.backends.protocol import ContextFull, Forward
from moerun.gguf.quants import RowTable
from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec

PAGE_TOKENS = 256
NO_EXPERTS = np.zeros(0, np.int64)       # the held ids of a layer this process holds none of


class NumpyBackend:
    name = "cpu"
    kind = "CPU"

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self._store: ExpertStore | None = None

    # -- weights
    def begin_loading(self, gguf: GGUFFile) -> None:
        pass

    def finish_loading(self) -> None:
        pass

    def matrix(self, gguf: GGUFFile, name: str) -> np.ndarray:
        """[N, K] float32; a 1-D tensor becomes one row."""
        values = gguf.dequantize(name)
        return values.reshape(1, -1) if values.ndim == 1 else values

    def vector(self, values: np.ndarray) -> np.ndarray:
        return values

    def embedding(self, gguf: GGUFFile, name: str) -> RowTable:
        return gguf.row_table(name)

    def load_experts(self, gguf: GGUFFile, held: dict[int, list[int]] | None, cache_bytes: int) -> CpuExperts:
        """Experts read from the mmap on first use, through one cache per backend."""
        if self._store is None:
            self._store = ExpertStore(gguf, self.spec, cache_bytes)
        return CpuExperts(self._store, held)

    # -- sequences and steps
    def new_cache(self, capacity: int) -> PagedKVCache:
        return PagedKVCache(self.spec, capacity)

    def run_step(self, forward: Forward, ids: np.ndarray, start: int, graph_key: tuple | None) -> np.ndarray:
        return forward(ids, start + np.arange(len(ids)))

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    # -- operations
    def embed(self, table: RowTable, ids: np.ndarray) -> np.ndarray:
        return table.lookup(ids)                                                 # [T, H]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return rms_norm(x, weight, self.spec.rms_eps)

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None,
               residual: np.ndarray | None = None) -> np.ndarray:
        """x [T, K] · weight [N, K]ᵀ (+ bias [N]) (+ residual [T, N])"""
        y = x @ weight.T
        if bias is not None:
            y = y + bias
        return y if residual is None else residual + y

    def linears(self, x: np.ndarray, weights: tuple, biases: tuple) -> tuple[np.ndarray, ...]:
        return tuple(self.linear(x, weight, bias) for weight, bias in zip(weights, biases))

    def rope_append(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm: np.ndarray | None,
                    k_norm: np.ndarray | None, cache: PagedKVCache, layer: int, positions: np.ndarray) -> np.ndarray:
        """Per-head norm (when given) and rope on q [T, NH*D] and k; k and v appended to
        the cache at `positions`. Returns the rotated q [T, NH, D]."""
        spec = self.spec
        n_tokens = q.shape[0]
        q = q.reshape(n_tokens, spec.n_heads, spec.head_dim_k)
        k = k.reshape(n_tokens, spec.n_kv_heads, spec.head_dim_k)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, spec.rms_eps), rms_norm(k, k_norm, spec.rms_eps)
        cos, sin = rope_tables(positions, spec.head_dim_k, spec.rope_base, spec.rope_scale)
        cache.append(layer, apply_rope(k, cos, sin, spec.rule.rope_style),
                     v.reshape(n_tokens, spec.n_kv_heads, spec.head_dim_v))
        return apply_rope(q, cos, sin, spec.rule.rope_style)

    def attention(self, q: np.ndarray, cache: PagedKVCache, layer: int, positions: np.ndarray) -> np.ndarray:
        """q [T, NH, D] over cache rows 0..positions[-1] -> [T, NH*Dv]"""
        keys, values = cache.rows(layer, int(positions[-1]) + 1)
        return causal_attention(q, keys, values, int(positions[0]))

    def route(self, h: np.ndarray, router: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return route(self.linear(h, router), self.spec.n_experts_used, self.spec.rule.renormalize_topk)

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return silu(gate) * up

    def add(self, x: np.ndarray, y: np.ndarray, gate_logit: np.ndarray | None = None) -> np.ndarray:
        """x + y, or x + sigmoid(gate_logit [T, 1]) · y"""
        return x + (y if gate_logit is None else y * sigmoid(gate_logit))


class PagedKVCache:
    """Keys and values of one sequence, grown in pages as the sequence grows."""

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
        if needed > self.capacity:
            raise ContextFull(needed, self.capacity)
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


class ExpertStore:
    """Dequantizes one expert at a time on first use; keeps the most recently used ones
    while they fit in `cache_bytes` of float32."""

    def __init__(self, gguf: GGUFFile, spec: ModelSpec, cache_bytes: int):
        self.gguf = gguf
        self.spec = spec
        self.cache_bytes = cache_bytes
        self.expert_bytes = 3 * spec.expert_ff * spec.hidden * 4
        self._cache: OrderedDict[tuple[int, int], ExpertWeights] = OrderedDict()
        for layer, is_moe in enumerate(spec.moe_layers):
            for name in spec.expert_tensor_names(layer) if is_moe else ():
                gguf.tensor(name)  # fail at load, not mid-generation, if one is missing

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


class CpuExperts:
    """Routed experts computed on the CPU from an ExpertStore: every expert (local ids are
    the global ones), or the `held` global ids per layer."""

    def __init__(self, store: ExpertStore, held: dict[int, list[int]] | None):
        self.store = store
        self.held = None if held is None else {layer: np.asarray(ids, np.int64) for layer, ids in held.items()}

    def every_expert(self) -> CpuExperts:
        """The same cache, addressed by global ids (a parent computing a failed daemon's pairs)."""
        return CpuExperts(self.store, None)

    def compute(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                out: np.ndarray | None = None) -> np.ndarray:
        """out[t] = Σ_k weights[t, k] · FFN_{ids[t, k]}(x[t]) over ids >= 0.
        x [T, H], ids/weights [T, K] -> [T, H]"""
        rows, slots = np.nonzero(ids >= 0)
        local = ids[rows, slots]
        experts = local if self.held is None else self.held.get(layer, NO_EXPERTS)[local]
        result = grouped_ffn(x, rows, experts, weights[rows, slots], self._expert(layer))
        if out is None:
            return result
        out[...] = result
        return out

    def _expert(self, layer: int) -> Callable[[int], ExpertWeights]:
        return lambda expert: self.store.get(layer, expert)


def load_expert(gguf: GGUFFile, spec: ModelSpec, layer: int, expert: int) -> ExpertWeights:
    """One expert dequantized to float32 from the mmap, without touching the others."""
    mats = [gguf.dequantize_expert(name, expert) for name in spec.expert_tensor_names(layer)]
    if spec.fused_gate_up:
        gate_up, down = mats                           # gate_up [2F, H], gate first
        return gate_up[: spec.expert_ff], gate_up[spec.expert_ff:], down
    gate, up, down = mats
    return gate, up, down
