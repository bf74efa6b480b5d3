"""The forward pass of a MoE transformer on the numpy reference backend.

Shape legend: T tokens in the chunk, H hidden, V vocab, NH/NKV heads, D head dim,
E experts, K experts per token, L layers.
"""
from __future__ import annotations

import numpy as np

from moerun.backends.numpy_ops import (
    apply_rope,
    causal_attention,
    rms_norm,
    rope_tables,
    sigmoid,
    swiglu_ffn,
)
from moerun.engine.kv_cache import KVCache
from moerun.engine.weights import LayerWeights, load_layer
from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec
from moerun.moe.dispatch import Dispatcher, LocalMoE
from moerun.moe.experts import ExpertStore
from moerun.moe.hotness import RoutingCounter
from moerun.moe.router import route


class MoEModel:
    def __init__(self, gguf: GGUFFile, spec: ModelSpec, expert_cache_bytes: int):
        self.gguf = gguf
        self.spec = spec
        self.layers: list[LayerWeights] = [load_layer(gguf, spec, i) for i in range(spec.n_layers)]
        self.experts = ExpertStore(gguf, spec, expert_cache_bytes)
        self.moe: LocalMoE | Dispatcher = LocalMoE(self.experts)   # the Runtime swaps in a Dispatcher for daemons
        self.routing_counter: RoutingCounter | None = None          # set by `moerun profile`
        self.output_norm = gguf.dequantize("output_norm.weight")                     # [H]
        head = "output.weight" if gguf.has_tensor("output.weight") else "token_embd.weight"
        self.output = gguf.dequantize(head)                                           # [V, H]

    def forward(self, ids: np.ndarray, cache: KVCache, all_logits: bool) -> np.ndarray:
        """Run ids [T] at positions cache.length.. and extend the cache.
        Returns logits [T, V] (all_logits) or [1, V] for the last position."""
        cache.reserve(len(ids))
        x = self.gguf.dequantize_rows("token_embd.weight", ids)                       # [T, H]
        positions = cache.length + np.arange(len(ids))
        cos, sin = rope_tables(positions, self.spec.head_dim_k, self.spec.rope_base, self.spec.rope_scale)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer, x, cache, cos, sin)
            h = rms_norm(x, layer.ffn_norm, self.spec.rms_eps)
            x = x + self._ffn(i, layer, h)
        cache.advance(len(ids))
        if not all_logits:
            x = x[-1:]
        return rms_norm(x, self.output_norm, self.spec.rms_eps) @ self.output.T

    def _attention(self, i: int, w: LayerWeights, x: np.ndarray, cache: KVCache,
                   cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        spec = self.spec
        n_tokens = x.shape[0]
        h = rms_norm(x, w.attn_norm, spec.rms_eps)
        q, k, v = h @ w.attn_q.T, h @ w.attn_k.T, h @ w.attn_v.T                      # [T, NH*D], [T, NKV*D]
        if w.attn_q_bias is not None:
            q, k, v = q + w.attn_q_bias, k + w.attn_k_bias, v + w.attn_v_bias
        q = _qk_norm(q, w.attn_q_norm, spec.head_dim_k, spec.rms_eps).reshape(n_tokens, spec.n_heads, spec.head_dim_k)
        k = _qk_norm(k, w.attn_k_norm, spec.head_dim_k, spec.rms_eps).reshape(n_tokens, spec.n_kv_heads, spec.head_dim_k)
        v = v.reshape(n_tokens, spec.n_kv_heads, spec.head_dim_v)
        q = apply_rope(q, cos, sin, spec.rule.rope_style)
        k = apply_rope(k, cos, sin, spec.rule.rope_style)
        keys, values = cache.append(i, k, v)
        return causal_attention(q, keys, values, cache.length) @ w.attn_output.T      # [T, H]

    def _ffn(self, i: int, w: LayerWeights, h: np.ndarray) -> np.ndarray:
        if w.ffn_dense is not None:
            return swiglu_ffn(h, *w.ffn_dense)
        ids, weights = route(h @ w.ffn_gate_inp.T, self.spec.n_experts_used, self.spec.rule.renormalize_topk)
        if self.routing_counter is not None:
            self.routing_counter.add(i, ids)
        pending = self.moe.begin(i, h, ids, weights)          # cold work is on its way to the daemons
        shared = None
        if w.ffn_shexp is not None:
            shared = swiglu_ffn(h, *w.ffn_shexp)
            if w.ffn_gate_inp_shexp is not None:
                shared = shared * sigmoid(h @ w.ffn_gate_inp_shexp)[:, None]
        out = pending.finish()                                                         # [T, H]
        return out if shared is None else out + shared


def _qk_norm(x: np.ndarray, weight: np.ndarray | None, head_dim: int, eps: float) -> np.ndarray:
    """RMSNorm per head when the weight is [D] (qwen3moe), over the whole
    projection when it is [heads*D] (olmoe); identity when absent."""
    if weight is None:
        return x
    if weight.shape[0] == head_dim:
        heads = x.reshape(x.shape[0], -1, head_dim)
        return rms_norm(heads, weight, eps).reshape(x.shape)
    return rms_norm(x, weight, eps)
