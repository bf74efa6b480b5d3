"""The forward pass of a MoE transformer, written once over a backend's operations
(moerun.backends: numpy on the CPU, CUDA or HIP on a GPU).

Shape legend: T tokens in the chunk, H hidden, V vocab, NH/NKV heads, D head dim,
E experts, K experts per token, L layers.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from moerun.engine.weights import LayerWeights, load_layer
from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec
from moerun.moe.hotness import RoutingCounter


class MoEModel:
    def __init__(self, gguf: GGUFFile, spec: ModelSpec, backend, expert_cache_bytes: int,
                 resident: dict[int, list[int]] | None = None):
        """resident: the routed experts per layer the parent holds when daemons hold the rest."""
        self.gguf = gguf
        self.spec = spec
        self.backend = backend
        self.routing_counter: RoutingCounter | None = None          # set by `moerun profile`
        backend.begin_loading(gguf)
        try:
            self.layers: list[LayerWeights] = [load_layer(gguf, spec, i, backend) for i in range(spec.n_layers)]
            self.moe = backend.local_moe(gguf, expert_cache_bytes, resident)  # the Runtime wraps it for daemons
            self.token_embd = backend.embedding(gguf, "token_embd.weight")             # [V, H]
            self.output_norm = backend.vector(gguf.dequantize("output_norm.weight"))   # [H]
            head = "output.weight" if gguf.has_tensor("output.weight") else "token_embd.weight"
            self.output = backend.matrix(gguf, head)                                   # [V, H]
        finally:
            backend.finish_loading()

    def forward(self, ids: np.ndarray, cache, all_logits: bool) -> np.ndarray:
        """Run ids [T] at positions cache.length.. and extend the cache.
        Returns float32 logits [T, V] (all_logits) or [1, V] for the last position."""
        cache.reserve(len(ids))
        logits = self.backend.run(self, ids, cache, all_logits)
        cache.advance(len(ids))
        return logits

    def forward_on_device(self, ids: Any, positions: Any, cache, all_logits: bool) -> Any:
        """The pass itself on the backend's arrays: ids [T], positions [T] -> logits.
        Launches device work only, so a GPU backend can capture it as a graph."""
        backend = self.backend
        x = backend.embed(self.token_embd, ids)                                        # [T, H]
        for i, layer in enumerate(self.layers):
            x = self._attention(i, layer, x, cache, positions)
            x = self._ffn(i, layer, x)
        if not all_logits:
            x = x[-1:]
        return backend.linear(backend.rms_norm(x, self.output_norm), self.output)     # [T, V]

    def _attention(self, i: int, w: LayerWeights, x: Any, cache, positions: Any) -> Any:
        backend, spec = self.backend, self.spec
        h = backend.rms_norm(x, w.attn_norm)
        q = backend.linear(h, w.attn_q, w.attn_q_bias)                                 # [T, NH*D]
        k = backend.linear(h, w.attn_k, w.attn_k_bias)                                 # [T, NKV*D]
        v = backend.linear(h, w.attn_v, w.attn_v_bias)                                 # [T, NKV*Dv]
        q_norm, k_norm = w.attn_q_norm, w.attn_k_norm
        if q_norm is not None and q_norm.shape[0] != spec.head_dim_k:   # olmoe: over the whole projection
            q, k = backend.rms_norm(q, q_norm), backend.rms_norm(k, k_norm)
            q_norm = k_norm = None
        q = backend.rope_append(q, k, v, q_norm, k_norm, cache, i, positions)           # [T, NH, D]
        attended = backend.attention(q, cache, i, positions)                           # [T, NH*Dv]
        return backend.linear(attended, w.attn_output, residual=x)                     # [T, H]

    def _ffn(self, i: int, w: LayerWeights, x: Any) -> Any:
        backend = self.backend
        h = backend.rms_norm(x, w.ffn_norm)
        if w.ffn_dense is not None:
            return backend.linear(self._swiglu(h, w.ffn_dense[:2]), w.ffn_dense[2], residual=x)
        ids, weights = backend.route(backend.linear(h, w.ffn_gate_inp))               # [T, K] each
        if self.routing_counter is not None:
            self.routing_counter.add(i, backend.to_host(ids))
        pending = self.moe.begin(i, h, ids, weights)          # cold work is on its way to the daemons
        shared = None
        if w.ffn_shexp is not None:
            shared = backend.linear(self._swiglu(h, w.ffn_shexp[:2]), w.ffn_shexp[2])
        routed = pending.finish()                                                      # [T, H]
        if shared is not None:
            gate = None if w.ffn_gate_inp_shexp is None else backend.linear(h, w.ffn_gate_inp_shexp)
            routed = backend.add(routed, shared, gate)
        return backend.add(x, routed)

    def _swiglu(self, h: Any, gate_up: tuple[Any, Any]) -> Any:
        gate, up = gate_up
        return self.backend.silu_mul(self.backend.linear(h, gate), self.backend.linear(h, up))
