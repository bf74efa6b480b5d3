"""Routed experts on the GPU, every expert of every layer resident in its stored type.

A few tokens (decode): two launches per layer for all selected experts — gate and
up with SwiGLU per (token, expert) pair, then down with the weighted sum over the
token's experts. Many tokens (prefill): pairs grouped by expert on the host, the
experts in use dequantized to f16 and multiplied as one batched product per
matrix, the results gathered back with their weights.

Shape legend: T tokens, H hidden, F expert FFN width, E experts, K experts per
token, P = T*K routed pairs, U experts in use, M padded tokens per expert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moerun.backends.gpu_kernels import MAX_GEMV_TOKENS
from moerun.backends.gpu_weights import UNIT, DeviceMatrix, Uploader
from moerun.models.spec import ModelSpec
from moerun.moe.dispatch import MoEStats
from moerun.moe.experts import expert_tensor_names

PAD_TOKENS = 16               # rows per expert in the batched products are a multiple of this


@dataclass
class LayerExperts:
    gate: Any                 # device bytes of expert 0's gate rows; expert e at + e * expert_bytes
    up: Any                   # same for up (inside the gate tensor when fused)
    gate_up: DeviceMatrix     # the stack holding gate (and up when fused), [E, F or 2F, H]
    up_stack: DeviceMatrix    # the stack holding up
    down: DeviceMatrix        # [E, H, F]


class GpuExperts:
    def __init__(self, backend, uploader: Uploader, spec: ModelSpec):
        self.backend = backend
        self.spec = spec
        self.stats = MoEStats()
        self.layers: dict[int, LayerExperts] = {}
        for layer, is_moe in enumerate(spec.moe_layers):
            if is_moe:
                self.layers[layer] = self._load(uploader, layer)

    def _load(self, uploader: Uploader, layer: int) -> LayerExperts:
        names = expert_tensor_names(self.spec, layer)
        mats = [uploader.matrix(name) for name in names]
        if self.spec.fused_gate_up:
            gate_up, down = mats
            up_offset = self.spec.expert_ff * gate_up.row_bytes
            return LayerExperts(gate_up.data, gate_up.data[up_offset:], gate_up, gate_up, down)
        gate, up, down = mats
        if gate.kind != up.kind:
            raise ValueError(f"layer {layer}: expert gate ({gate.kind}) and up ({up.kind}) tensors of different "
                             "types are not supported on the GPU")
        return LayerExperts(gate.data, up.data, gate, up, down)

    def begin(self, layer: int, x: Any, ids: Any, weights: Any) -> "PendingExperts":
        """x [T, H], ids/weights [T, K] on the device; the work is queued on the stream now."""
        n_tokens, top_k = ids.shape
        self.stats.moe_layer_calls += 1
        self.stats.hot_only_layer_calls += 1
        self.stats.routed_pairs += n_tokens * top_k
        experts = self.layers[layer]
        if n_tokens <= MAX_GEMV_TOKENS:
            return PendingExperts(self._few_tokens(experts, x, ids, weights))
        return PendingExperts(self._grouped(experts, x, ids, weights))

    def _few_tokens(self, experts: LayerExperts, x: Any, ids: Any, weights: Any) -> Any:
        backend, spec = self.backend, self.spec
        cupy, kernels = backend.cupy, backend.kernels
        n_tokens, top_k = ids.shape
        hidden, ffn = spec.hidden, spec.expert_ff
        stack = experts.gate_up
        act = cupy.empty((n_tokens * top_k, ffn), cupy.float32)                      # [P, F]
        kernels.rows(f"moe_gate_up_{stack.kind}", ffn, hidden // UNIT, n_tokens * top_k,
                     (experts.gate, experts.up, np.int64(stack.expert_bytes), np.int64(stack.row_bytes),
                      x, np.int32(hidden), ids, np.int32(top_k), act, np.int32(ffn)))
        down = experts.down
        out = cupy.empty((n_tokens, hidden), cupy.float32)                            # [T, H]
        kernels.rows(f"moe_down_{down.kind}", hidden, ffn // UNIT, n_tokens,
                     (down.data, np.int64(down.expert_bytes), np.int64(down.row_bytes), act, np.int32(ffn),
                      ids, weights, np.int32(top_k), out, np.int32(hidden), np.uint64(0)))
        return out

    def _grouped(self, experts: LayerExperts, x: Any, ids: Any, weights: Any) -> Any:
        backend, spec = self.backend, self.spec
        cupy, kernels = backend.cupy, backend.kernels
        n_tokens, top_k = ids.shape
        groups = group_by_expert(backend.to_host(ids), top_k)
        used = cupy.asarray(groups.experts)                                           # [U]
        rows = cupy.asarray(groups.token_rows)                                        # [U*M]
        xg = cupy.empty((groups.token_rows.size, spec.hidden), cupy.float16)          # [U*M, H]
        kernels.elementwise("gather_rows_f16", xg.size, (x, rows, np.int32(spec.hidden), np.int64(rows.size), xg))
        xg = xg.reshape(used.size, groups.padded_tokens, spec.hidden)                 # [U, M, H]
        gate = backend.blas.matmul(xg, self._dequantize_gate_up(experts, used, up=False))   # [U, M, F]
        up = backend.blas.matmul(xg, self._dequantize_gate_up(experts, used, up=True))
        act = cupy.empty(gate.shape, cupy.float16)
        kernels.elementwise("silu_mul_f16", act.size, (gate, up, act, np.int64(act.size)))
        down = backend.blas.matmul(act, backend.dequantize_f16(experts.down, used))          # [U, M, H]
        out = cupy.empty((n_tokens, spec.hidden), cupy.float32)
        slots = cupy.asarray(groups.pair_slots)                                       # [P]
        kernels.elementwise("combine_rows", out.size, (down, slots, weights, np.int32(top_k), np.int32(spec.hidden),
                                                       np.int64(n_tokens), np.uint64(0), out))
        return out

    def _dequantize_gate_up(self, experts: LayerExperts, used: Any, up: bool) -> Any:
        """f16 [U, F, H] of the experts in use."""
        backend, ffn = self.backend, self.spec.expert_ff
        if not self.spec.fused_gate_up:
            return backend.dequantize_f16(experts.up_stack if up else experts.gate_up, used)
        both = backend.dequantize_f16(experts.gate_up, used)                           # [U, 2F, H]
        return backend.cupy.ascontiguousarray(both[:, ffn:] if up else both[:, :ffn])


@dataclass
class PendingExperts:
    out: Any

    def finish(self) -> Any:
        return self.out


@dataclass
class ExpertGroups:
    experts: np.ndarray        # int32 [U] experts in use, ascending
    padded_tokens: int         # M
    token_rows: np.ndarray     # int32 [U*M]: row of x for each slot, -1 for padding
    pair_slots: np.ndarray     # int32 [P]: slot u*M + m holding each (token, k) pair


def group_by_expert(ids: np.ndarray, top_k: int) -> ExpertGroups:
    """Lay the routed pairs ids [T, K] out expert by expert, M slots per expert."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    padded = -(-int(counts.max()) // PAD_TOKENS) * PAD_TOKENS
    group = np.repeat(np.arange(experts.size), counts)                 # group of each sorted pair
    slot_of_sorted = group * padded + (np.arange(flat.size) - starts[group])
    token_rows = np.full(experts.size * padded, -1, np.int32)
    token_rows[slot_of_sorted] = order // top_k
    pair_slots = np.empty(flat.size, np.int32)
    pair_slots[order] = slot_of_sorted
    return ExpertGroups(experts.astype(np.int32), padded, token_rows, pair_slots)
