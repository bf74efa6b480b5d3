"""The reference backend: every operation in float32 numpy on the CPU (the math is in
numpy_ops), but for the weight matrices, which the CPU kernels (moerun.backends.cpu) multiply
straight from their stored blocks in the mmap: the routed experts (QuantizedExperts) and the
dense matrices, attention, shared experts and the LM head (StoredMatrix). F32 matrices (the
routers) stay numpy, on a view of the mapping (routing multiplies them in the kernels); the
embedding rows are dequantized on use.

The work of a layer around its products (rms_norm, the q/k norms with rope and the cache append,
attention, the router's softmax and top-K) runs in the kernels too, a call or two each: no
numpy BLAS runs between the kernels' jobs (its threads spin after a call, on the cores the
kernels' threads need).

Where the kernels cannot run (no C compiler, a type they do not read) the dense matrices are
dequantized to float32 at load, and the experts one at a time on first use, straight from the
mmap, into a byte-bounded cache, and every operation is numpy_ops': the float32 reference the
kernels' tests compare against. The KV cache grows in pages as the sequence does.
Shape legend: T tokens, H hidden, N output rows, NH/NKV heads, D/Dv head dims,
E experts, K experts per token, F expert FFN width, S cached positions.
"""
from __future__ import annotations

import ctypes
import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from moerun.backends.cpu.library import (
    AttentionShape,
    CpuKernels,
    ExpertMatrices,
    Matrix,
    address,
    default_threads,
    float_matrix,
    kernel_error,
    load_kernels,
)
from moerun.backends.kv_types import KV_TYPES, KVTypes, decode, empty_rows, encode
from moerun.backends.numpy_ops import (
    ExpertWeights,
    apply_rope,
    causal_attention,
    causal_conv,
    gated_delta_rule,
    grouped_ffn,
    l2_norm,
    rms_norm,
    rope_tables,
    route,
    sigmoid,
    silu,
    softplus,
)
from moerun.backends.protocol import CacheState, ContextFull, Forward, RecurrentStates, swiglu_by_products
from moerun.errors import UsageError
from moerun.gguf.quants import RowTable, T, row_ids, row_nbytes
from moerun.gguf.reader import GGUFError, GGUFFile
from moerun.models.spec import ModelSpec
from moerun.units import available_host_bytes

PAGE_TOKENS = 256
NO_EXPERTS = np.zeros(0, np.int64)       # the held ids of a layer this process holds none of

logger = logging.getLogger(__name__)


class NumpyBackend:
    name = "cpu"
    kind = "CPU"
    captured_steps = 0
    step_tokens = 0
    cache_grows = True

    def __init__(self, spec: ModelSpec, threads: int | None = None, kv_types: KVTypes = KVTypes()):
        """threads: the CPU kernels' (default_threads() if None); kv_types: its KV caches' elements."""
        kv_types.check_dims(spec.head_dim_k, spec.head_dim_v)
        self.spec = spec
        self.threads = threads
        self.kv_types = kv_types
        self._store: ExpertStore | None = None
        self._rope: tuple[bytes, np.ndarray, np.ndarray] | None = None      # the last positions, cos, sin
        self._routers: dict[int, tuple[np.ndarray, np.ndarray, Matrix]] = {}   # id -> router, as float32, struct
        self._kernels = load_kernels()            # for the work around the products; None: numpy_ops
        self._kernel_threads = threads or default_threads()
        self._rotary_dims = spec.rotary_dims               # rope over all of a head's dims, or its first ones
        self._attention_shape = AttentionShape(spec.n_heads, spec.n_kv_heads, spec.head_dim_k, spec.head_dim_v,
                                               spec.rule.rope_style == "neox", spec.rms_eps,
                                               1.0 / np.sqrt(spec.head_dim_k), int(KV_TYPES[kv_types.key]),
                                               int(KV_TYPES[kv_types.value]))

    # -- weights
    def begin_loading(self, gguf: GGUFFile) -> None:
        self._loading = (gguf.path.name, set())           # the file, the types dequantized to float32

    def finish_loading(self) -> None:
        name, float_types = self._loading
        if float_types:
            logger.warning(f"{name}: the CPU kernels do not read matrices of type {', '.join(sorted(float_types))}; "
                           f"those are dequantized to float32 and multiplied with numpy instead (slower, and 4 "
                           f"bytes of memory per weight)")

    def matrix(self, gguf: GGUFFile, name: str) -> np.ndarray | StoredMatrix:
        """[N, K]: as stored, for the CPU kernels, where they read its type; F32 as a float32 view
        of the mapping; else (with a notice) dequantized to float32. A 1-D tensor becomes one row."""
        info = gguf.tensor(name)
        kernels = load_kernels()
        if info.ggml_type == T.F32:
            return gguf.raw(name).reshape(-1, info.shape[-1])
        if kernels is not None and kernels.supports(info.ggml_type):
            return StoredMatrix(kernels, gguf.raw(name), info.ggml_type, info.shape[-1],
                                self.threads or default_threads(), name)
        if kernels is not None:
            self._loading[1].add(info.ggml_type.name)
        return gguf.dequantize(name).reshape(-1, info.shape[-1])

    def vector(self, values: np.ndarray) -> np.ndarray:
        return np.array(values, np.float32)           # its own (writable) copy: the kernels take its address fastest

    def embedding(self, gguf: GGUFFile, name: str) -> StoredMatrix | RowTable:
        """[V, H] whose rows embed() looks up: as stored, dequantized by the CPU kernels a row at
        a time where they read its type (gguf.quants takes ~0.3 ms for one Q4_K row of 2048)."""
        table = gguf.row_table(name)                     # checked: 2-D, of a type that dequantizes
        kernels = load_kernels()
        if kernels is None or not kernels.supports(table.ggml_type):
            return table
        return StoredMatrix(kernels, table.raw, table.ggml_type, gguf.tensor(name).shape[-1], threads=1, name=name)

    def load_experts(self, gguf: GGUFFile, held: dict[int, list[int]] | None, cache_bytes: int) -> CpuExperts:
        """Experts computed from the mmap, through one store per backend."""
        if self._store is None:
            self._store = expert_store(gguf, self.spec, cache_bytes, self.threads)
        return CpuExperts(self._store, held)

    # -- sequences and steps
    def context_memory(self, ubatch: int) -> tuple[int, int]:
        """The host's available memory; a prefill chunk packs the cache's rows as float32."""
        spec = self.spec
        return available_host_bytes(), 4 * spec.n_kv_heads * (spec.head_dim_k + spec.head_dim_v)

    def new_cache(self, capacity: int) -> PagedKVCache:
        return PagedKVCache(self.spec, capacity, self.kv_types)

    def restore_cache(self, state: CacheState, capacity: int) -> PagedKVCache:
        cache = self.new_cache(capacity)
        cache.reserve(state.length)
        for layer, keys in state.keys.items():
            k_rows, v_rows = cache.next_rows(layer, state.length)
            k_rows[...], v_rows[...] = keys, state.values[layer]
        cache.conv = {layer: conv.copy() for layer, conv in state.conv.items()}
        cache.ssm = {layer: ssm.copy() for layer, ssm in state.ssm.items()}
        cache.advance(state.length)
        return cache

    def run_step(self, forward: Forward, inputs: np.ndarray, start: int, graph_key: tuple | None) -> np.ndarray:
        return forward(inputs, start + np.arange(len(inputs)))

    def hop(self, x: np.ndarray, action) -> np.ndarray:
        return np.asarray(action(x), np.float32)

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    # -- operations
    def embed(self, table: StoredMatrix | RowTable, ids: np.ndarray) -> np.ndarray:
        return table.lookup(ids)                                                 # [T, H]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """x [T, n], weight [n]"""
        if self._kernels is None:
            return rms_norm(x, weight, self.spec.rms_eps)
        return self._kernels.rms_norm(x, weight, self.spec.rms_eps)

    def linear(self, x: np.ndarray, weight: np.ndarray | StoredMatrix, bias: np.ndarray | None = None,
               residual: np.ndarray | None = None) -> np.ndarray:
        """x [T, K] · weight [N, K]ᵀ (+ bias [N]) (+ residual [T, N])"""
        y = stored_products(x, [weight]) if isinstance(weight, StoredMatrix) else x @ weight.T
        if bias is not None:
            y = y + bias
        return y if residual is None else residual + y

    def linears(self, x: np.ndarray, weights: tuple, biases: tuple,
                norm: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        """Stored matrices in one call of the kernels (column views of its [T, ΣN] output)."""
        if norm is not None:
            x = self.rms_norm(x, norm)
        if not all(isinstance(weight, StoredMatrix) for weight in weights):
            return tuple(self.linear(x, weight, bias) for weight, bias in zip(weights, biases))
        y, parts, start = stored_products(x, weights), [], 0       # slices: a tenth of np.split's cost
        for weight, bias in zip(weights, biases):
            part = y[:, start:start + weight.shape[0]]
            parts.append(part if bias is None else part + bias)
            start += weight.shape[0]
        return tuple(parts)

    def swiglu_ffn(self, x: np.ndarray, ffn: tuple, residual: np.ndarray | None = None) -> np.ndarray:
        """down · (silu(gate · x) · up · x) (+ residual): gate and up in one call of the kernels"""
        return swiglu_by_products(self, x, ffn, residual)

    def rope_append(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm: np.ndarray | None,
                    k_norm: np.ndarray | None, cache: PagedKVCache, layer: int, positions: np.ndarray) -> np.ndarray:
        """Per-head norm (when given) and rope on q [T, NH*D] and k; k and v appended to
        the cache at `positions`. Returns the rotated q [T, NH, D]."""
        spec = self.spec
        n_tokens = q.shape[0]
        cos, sin = self._rope_tables(positions)
        if self._kernels is not None and self._rotary_dims == spec.head_dim_k:     # the kernels rotate whole heads
            return self._kernels.rope_append(self._attention_shape, q, k, v, q_norm, k_norm, cos, sin,
                                             *cache.next_rows(layer, n_tokens), self._kernel_threads)
        q = q.reshape(n_tokens, spec.n_heads, spec.head_dim_k)
        k = k.reshape(n_tokens, spec.n_kv_heads, spec.head_dim_k)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, spec.rms_eps), rms_norm(k, k_norm, spec.rms_eps)
        cache.append(layer, apply_rope(k, cos, sin, spec.rule.rope_style),
                     v.reshape(n_tokens, spec.n_kv_heads, spec.head_dim_v))
        return apply_rope(q, cos, sin, spec.rule.rope_style)

    def _rope_tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [T, D/2] of positions [T], computed once per step (every layer asks)."""
        key = positions.tobytes()
        if self._rope is None or key != self._rope[0]:
            spec = self.spec
            self._rope = (key, *rope_tables(positions, self._rotary_dims, spec.rope_base, spec.rope_scale))
        return self._rope[1:]

    def attention(self, q: np.ndarray, cache: PagedKVCache, layer: int, positions: np.ndarray) -> np.ndarray:
        """q [T, NH, D] over cache rows 0..positions[-1] -> [T, NH*Dv]"""
        keys, values = cache.rows(layer, int(positions[-1]) + 1)
        if self._kernels is not None:
            return self._kernels.attention(self._attention_shape, q, int(positions[0]), keys, values,
                                           self._kernel_threads)
        types = self.kv_types
        return causal_attention(q, decode(types.key, keys), decode(types.value, values), int(positions[0]))

    def tree_attention(self, q: np.ndarray, cache: PagedKVCache, layer: int, among: np.ndarray) -> np.ndarray:
        """q [T, NH, D] of a speculative tree's nodes, written at the cache's next T rows, each over
        every row before them and the nodes `among` [T, T] says (its ancestors and itself) -> [T, NH*Dv]"""
        start = cache.length
        keys, values = cache.rows(layer, start + len(q))
        types = self.kv_types
        return causal_attention(q, decode(types.key, keys), decode(types.value, values), start, among)

    def concat(self, parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts)

    def route(self, x: np.ndarray, norm: np.ndarray,
              router: np.ndarray | StoredMatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        spec = self.spec
        if self._kernels is None:
            h = self.rms_norm(x, norm)
            return h, *route(self.linear(h, router), spec.n_experts_used, spec.rule.renormalize_topk)
        matrix = router.struct if isinstance(router, StoredMatrix) else self._float_router(router)
        return self._kernels.route(matrix, x, norm, spec.rms_eps, spec.n_experts_used, spec.rule.renormalize_topk,
                                   self._kernel_threads)

    def _float_router(self, router: np.ndarray) -> Matrix:
        """The struct of a router [E, H] of floats, made once (the entry holds the array, so that
        its id stays its own)."""
        if id(router) not in self._routers:
            floats = np.ascontiguousarray(router, np.float32)
            self._routers[id(router)] = (router, floats, float_matrix(floats))
        return self._routers[id(router)][2]

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return silu(gate) * up

    def query_gate(self, q_gate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """q_gate [T, NH*2D], each head's query then its gate -> q, gate [T, NH*D]"""
        heads = q_gate.reshape(len(q_gate), self.spec.n_heads, 2, self.spec.head_dim_k)
        return heads[:, :, 0].reshape(len(q_gate), -1), heads[:, :, 1].reshape(len(q_gate), -1)

    def sigmoid_gate(self, x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        """x · sigmoid(gate), both [T, N]"""
        return x * sigmoid(gate)

    def delta_net(self, channels: np.ndarray, z: np.ndarray, beta: np.ndarray, alpha: np.ndarray,
                  weights: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], cache: PagedKVCache,
                  layer: int) -> np.ndarray:
        """A gated DeltaNet layer's mixing from its projections, the layer's states in `cache`
        advanced: channels [T, C] (q, k, v before the convolution), z [T, HV*DV], beta and
        alpha [T, HV]; weights: conv [C, W], a and dt [HV], norm [DV] -> [T, HV*DV] (each head's
        output RMS-normed, times silu(z))."""
        conv_weight, a, dt, norm = weights
        shape, eps, n_tokens = self.spec.delta_net, self.spec.rms_eps, len(channels)
        key_width = shape.key_heads * shape.key_dim
        mixed, cache.conv[layer] = causal_conv(channels, conv_weight, cache.conv[layer])
        q = l2_norm(mixed[:, :key_width].reshape(n_tokens, shape.key_heads, shape.key_dim), eps)
        k = l2_norm(mixed[:, key_width:2 * key_width].reshape(n_tokens, shape.key_heads, shape.key_dim), eps)
        v = mixed[:, 2 * key_width:].reshape(n_tokens, shape.value_heads, shape.value_dim)
        decay = softplus(alpha + dt) * a                       # [T, HV], <= 0
        out = gated_delta_rule(q, k, v, decay, sigmoid(beta), cache.ssm[layer])        # [T, HV, DV]
        gate = z.reshape(n_tokens, shape.value_heads, shape.value_dim)
        return (rms_norm(out, norm, eps) * silu(gate)).reshape(n_tokens, -1)

    def add(self, x: np.ndarray, y: np.ndarray, gate_logit: np.ndarray | None = None) -> np.ndarray:
        """x + y, or x + sigmoid(gate_logit [T, 1]) · y"""
        return x + (y if gate_logit is None else y * sigmoid(gate_logit))


class PagedKVCache:
    """Keys and values of one sequence in its KV types (kv_types.empty_rows), grown in pages as
    the sequence grows; a DeltaNet layer's states instead of its keys and values: conv [W-1, C],
    the last inputs of its convolution, and ssm [HV, DK, DV], the recurrent state of each value
    head."""

    def __init__(self, spec: ModelSpec, capacity: int, types: KVTypes = KVTypes()):
        self.capacity = capacity
        self.length = 0
        self.types = types
        recurrent = [spec.is_recurrent(i) for i in range(spec.n_layers)]
        self._k = [empty_rows(types.key, (0, 0 if r else spec.n_kv_heads, spec.head_dim_k)) for r in recurrent]
        self._v = [empty_rows(types.value, (0, 0 if r else spec.n_kv_heads, spec.head_dim_v)) for r in recurrent]
        shape = spec.delta_net
        layers = [i for i, r in enumerate(recurrent) if r]
        self.conv = {i: np.zeros((shape.conv_kernel - 1, shape.channels), np.float32) for i in layers}
        self.ssm = {i: np.zeros((shape.value_heads, shape.key_dim, shape.value_dim), np.float32) for i in layers}

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
        """Write float32 k [T, NKV, D], v [T, NKV, Dv] after the current length, in the cache's types."""
        k_rows, v_rows = self.next_rows(layer, k.shape[0])
        k_rows[...] = encode(self.types.key, k)
        v_rows[...] = encode(self.types.value, v)

    def next_rows(self, layer: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of the n_tokens positions after the current length: k [T, NKV, D], v [T, NKV, Dv]
        (as stored)."""
        end = self.length + n_tokens
        return self._k[layer][self.length:end], self._v[layer][self.length:end]

    def rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of positions 0..end-1 of one layer: k [S, NKV, D], v [S, NKV, Dv] (as stored)."""
        return self._k[layer][:end], self._v[layer][:end]

    def advance(self, n_tokens: int) -> None:
        self.length += n_tokens

    def truncate(self, length: int) -> None:
        """Keep positions 0..length-1 of the attention layers (their rows stay; the next ones are
        written over). A DeltaNet layer's state has taken the dropped positions in: the caller
        restores one from before them (restore_recurrent)."""
        self.length = min(self.length, length)

    def keep_rows(self, start: int, rows: Sequence[int]) -> None:
        """Positions start.. to hold the rows `rows` (ascending, each at or past its new place: a
        tree verify's accepted path), and no more."""
        for layer in range(len(self._k)):
            if layer not in self.conv:
                self._k[layer][start:start + len(rows)] = self._k[layer][list(rows)]
                self._v[layer][start:start + len(rows)] = self._v[layer][list(rows)]
        self.length = start + len(rows)

    def recurrent_states(self) -> RecurrentStates:
        return RecurrentStates({i: a.copy() for i, a in self.conv.items()}, {i: a.copy() for i, a in self.ssm.items()})

    def restore_recurrent(self, states: RecurrentStates) -> None:
        for mine, saved in ((self.conv, states.conv), (self.ssm, states.ssm)):
            for layer, state in saved.items():
                mine[layer][...] = state

    def snapshot(self) -> CacheState:
        attention = [layer for layer in range(len(self._k)) if layer not in self.conv]
        return CacheState(self.length, keys={i: self._k[i][:self.length].copy() for i in attention},
                          values={i: self._v[i][:self.length].copy() for i in attention},
                          conv={i: a.copy() for i, a in self.conv.items()},
                          ssm={i: a.copy() for i, a in self.ssm.items()})


def _grown(array: np.ndarray, size: int) -> np.ndarray:
    grown = np.empty((size, *array.shape[1:]), array.dtype)
    grown[: array.shape[0]] = array
    return grown


class StoredMatrix:
    """A weight matrix [N, K] multiplied by the CPU kernels straight from its blocks in the
    mapped file: nothing is dequantized or copied, so memory stays at the mapped bytes."""

    def __init__(self, kernels: CpuKernels, raw: np.ndarray, ggml_type: T, cols: int, threads: int, name: str = ""):
        row_bytes = row_nbytes(ggml_type, cols)
        self.kernels = kernels
        self.raw = raw                         # the mapped bytes, alive as long as the struct points into them
        self.threads = threads
        self.name = name
        self.shape = (raw.nbytes // row_bytes, cols)
        self.struct = Matrix(raw.ctypes.data, int(ggml_type), self.shape[0], cols, row_bytes, raw.nbytes)

    def lookup(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Float32 rows [len(rows), K], as RowTable.lookup gives them."""
        return self.kernels.rows(self.struct, row_ids(rows, self.shape[0], self.name))


def stored_products(x: np.ndarray, matrices: Sequence[StoredMatrix]) -> np.ndarray:
    """x [T, K] · Wᵢᵀ for each matrix, side by side: [T, ΣN]."""
    return matrices[0].kernels.matmul([matrix.struct for matrix in matrices], x, matrices[0].threads)


class QuantizedExperts:
    """Routed experts multiplied by the CPU kernels straight from their stored blocks: nothing
    is copied or dequantized ahead, so memory stays at the mapped bytes and an expert is ready
    as soon as the file is open. `layers`: each MoE layer's matrices, pointing into arrays
    (views of the mapped file) that `keep` holds alive."""

    def __init__(self, kernels: CpuKernels, layers: dict[int, ExpertMatrices], threads: int,
                 keep: list[np.ndarray]):
        self.kernels = kernels
        self.layers = layers
        self.threads = threads
        self._keep = keep

    @classmethod
    def of_file(cls, kernels: CpuKernels, gguf: GGUFFile, spec: ModelSpec, threads: int) -> QuantizedExperts:
        views: list[np.ndarray] = []
        layers = {layer: _expert_matrices(gguf, spec, layer, views)
                  for layer, is_moe in enumerate(spec.moe_layers) if is_moe}
        return cls(kernels, layers, threads, views)

    def grouped_ffn(self, layer: int, x: np.ndarray, rows: np.ndarray, experts: np.ndarray,
                    weights: np.ndarray) -> np.ndarray:
        """out[rows[p]] += weights[p] · FFN_{experts[p]}(x[rows[p]]).  x [T, H]; rows, experts,
        weights [P] -> [T, H]"""
        matrices = self.layers[layer]
        if x.ndim != 2 or x.shape[1] != matrices.down.rows:
            raise UsageError(f"layer {layer}'s experts take rows of {matrices.down.rows} values, not {x.shape[1:]}")
        x = np.ascontiguousarray(x, np.float32)
        rows = np.ascontiguousarray(rows, np.int64)
        experts = np.ascontiguousarray(experts, np.int64)
        weights = np.ascontiguousarray(weights, np.float32)
        out = np.empty_like(x)
        status = self.kernels.lib.moe_ffn(ctypes.byref(matrices), address(x), len(x), address(rows),
                                          address(experts), address(weights), len(rows), address(out), self.threads)
        if status:
            raise kernel_error(status)
        return out

    def padded_ffn(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                   expert_map: np.ndarray | None = None) -> np.ndarray:
        """out[t] = Σ_k weights[t, k] · FFN_e(x[t]) over ids[t, k] >= 0, e = expert_map[id] (or the
        id itself without a map), the pairs as a router leaves them.  x [T, H]; ids, weights
        [T, K] -> [T, H]"""
        matrices = self.layers[layer]
        if x.ndim != 2 or x.shape[1] != matrices.down.rows or ids.ndim != 2 or ids.shape != weights.shape \
                or len(ids) != len(x):
            raise UsageError(f"layer {layer}'s experts take x [T, {matrices.down.rows}] and ids and weights [T, K], "
                             f"not {x.shape}, {ids.shape} and {weights.shape}")
        x = np.ascontiguousarray(x, np.float32)
        ids = np.ascontiguousarray(ids, np.int64)
        weights = np.ascontiguousarray(weights, np.float32)
        out = np.empty_like(x)
        expert_map = None if expert_map is None else np.ascontiguousarray(expert_map, np.int64)
        status = self.kernels.lib.moe_ffn_padded(ctypes.byref(matrices), address(x), len(x), address(ids),
                                                 address(weights), ids.shape[1],
                                                 None if expert_map is None else address(expert_map),
                                                 0 if expert_map is None else len(expert_map), address(out),
                                                 self.threads)
        if status:
            raise kernel_error(status)
        return out


def _expert_matrices(gguf: GGUFFile, spec: ModelSpec, layer: int, views: list[np.ndarray]) -> ExpertMatrices:
    """One layer's gate, up [E, F, H] and down [E, H, F] as stored; the tensors' views go to `views`."""
    def stored(name: str, shape: tuple[int, int, int]) -> Matrix:
        info = gguf.tensor(name)
        if info.shape != shape:
            raise GGUFError(gguf.path, f"tensor '{name}' has shape {info.shape}, expected {shape}")
        views.append(gguf.raw(name))
        row_bytes = row_nbytes(info.ggml_type, shape[2])
        return Matrix(views[-1].ctypes.data, int(info.ggml_type), shape[1], shape[2], row_bytes, shape[1] * row_bytes)

    names = spec.expert_tensor_names(layer)
    n_experts, hidden, ffn = spec.n_experts, spec.hidden, spec.expert_ff
    down = stored(names[-1], (n_experts, hidden, ffn))
    if not spec.fused_gate_up:
        return ExpertMatrices(stored(names[0], (n_experts, ffn, hidden)), stored(names[1], (n_experts, ffn, hidden)),
                              down, n_experts)
    gate_up = stored(names[0], (n_experts, 2 * ffn, hidden))                             # gate rows first
    gate = Matrix(gate_up.data, gate_up.type, ffn, hidden, gate_up.row_bytes, gate_up.expert_bytes)
    up = Matrix(gate_up.data + ffn * gate_up.row_bytes, gate_up.type, ffn, hidden, gate_up.row_bytes,
                gate_up.expert_bytes)
    return ExpertMatrices(gate, up, down, n_experts)


class DequantizedExperts:
    """Dequantizes one expert at a time on first use; keeps the most recently used ones
    while they fit in `cache_bytes` of float32."""

    def __init__(self, gguf: GGUFFile, spec: ModelSpec, cache_bytes: int):
        self.gguf = gguf
        self.spec = spec
        self.cache_bytes = cache_bytes
        self.expert_bytes = float32_expert_bytes(spec)
        self._cache: OrderedDict[tuple[int, int], ExpertWeights] = OrderedDict()
        for layer, is_moe in enumerate(spec.moe_layers):
            for name in spec.expert_tensor_names(layer) if is_moe else ():
                gguf.tensor(name)  # fail at load, not mid-generation, if one is missing

    def grouped_ffn(self, layer: int, x: np.ndarray, rows: np.ndarray, experts: np.ndarray,
                    weights: np.ndarray) -> np.ndarray:
        """out[rows[p]] += weights[p] · FFN_{experts[p]}(x[rows[p]]).  x [T, H]; rows, experts,
        weights [P] -> [T, H]"""
        return grouped_ffn(x, rows, experts, weights, lambda expert: self.get(layer, expert))

    def padded_ffn(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                   expert_map: np.ndarray | None = None) -> np.ndarray:
        """As QuantizedExperts.padded_ffn: ids, weights [T, K] (< 0: none), through expert_map."""
        rows, slots = np.nonzero(ids >= 0)
        local = ids[rows, slots]
        experts = local if expert_map is None else np.asarray(expert_map)[local]
        return self.grouped_ffn(layer, x, rows, experts, weights[rows, slots])

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


ExpertStore = QuantizedExperts | DequantizedExperts


def float32_expert_bytes(spec: ModelSpec) -> int:
    """One expert's gate, up and down dequantized to float32."""
    return 3 * spec.expert_ff * spec.hidden * 4


def expert_store(gguf: GGUFFile, spec: ModelSpec, cache_bytes: int, threads: int | None = None) -> ExpertStore:
    """The CPU kernels over the stored blocks (`threads` threads, default_threads() if None),
    where this machine has them and they read every expert tensor's type; otherwise, with a
    notice, experts dequantized to float32 (at most `cache_bytes` of them kept)."""
    kernels = load_kernels()
    if kernels is not None:
        missing = {gguf.tensor(name).ggml_type.name for layer, is_moe in enumerate(spec.moe_layers) if is_moe
                   for name in spec.expert_tensor_names(layer) if not kernels.supports(gguf.tensor(name).ggml_type)}
        if not missing:
            return QuantizedExperts.of_file(kernels, gguf, spec, threads or default_threads())
        logger.warning(f"{gguf.path.name}: the CPU kernels do not read expert tensors of type "
                       f"{', '.join(sorted(missing))}; those experts are dequantized to float32 and multiplied "
                       f"with numpy instead (slower, and 4 bytes of memory per weight)")
    return DequantizedExperts(gguf, spec, cache_bytes)


class CpuExperts:
    """Routed experts computed on the CPU from an ExpertStore: every expert (local ids are
    the global ones), or the `held` global ids per layer."""

    def __init__(self, store: ExpertStore, held: dict[int, list[int]] | None):
        self.store = store
        self.held = None if held is None else {layer: np.asarray(ids, np.int64) for layer, ids in held.items()}

    def every_expert(self) -> CpuExperts:
        """The same store, addressed by global ids (a parent computing a failed daemon's pairs)."""
        return CpuExperts(self.store, None)

    def compute(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                out: np.ndarray | None = None, residual: np.ndarray | None = None) -> np.ndarray:
        """out[t] = (residual[t] +) Σ_k weights[t, k] · FFN_{ids[t, k]}(x[t]) over ids >= 0.
        x [T, H], ids/weights [T, K] -> [T, H]"""
        expert_map = None if self.held is None else self.held.get(layer, NO_EXPERTS)
        result = self.store.padded_ffn(layer, x, ids, weights, expert_map)
        if residual is not None:
            result = residual + result
        if out is None:
            return result
        out[...] = result
        return out


def load_expert(gguf: GGUFFile, spec: ModelSpec, layer: int, expert: int) -> ExpertWeights:
    """One expert dequantized to float32 from the mmap, without touching the others."""
    mats = [gguf.dequantize_expert(name, expert) for name in spec.expert_tensor_names(layer)]
    if spec.fused_gate_up:
        gate_up, down = mats                           # gate_up [2F, H], gate first
        return gate_up[: spec.expert_ff], gate_up[spec.expert_ff:], down
    gate, up, down = mats
    return gate, up, down
