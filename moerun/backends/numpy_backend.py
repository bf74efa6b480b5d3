"""The reference backend: every operation in float32 numpy on the CPU.

Weights are dequantized at load (embeddings row by row on use); the experts are
dequantized one at a time into a bounded cache (moerun.moe.experts).
Shape legend: T tokens, H hidden, N output rows, NH/NKV heads, D/Dv head dims,
E experts, K experts per token.
"""
from __future__ import annotations

import numpy as np

from moerun.backends.numpy_ops import (
    apply_rope,
    causal_attention,
    rms_norm,
    rope_tables,
    sigmoid,
    silu,
)
from moerun.engine.kv_cache import KVCache
from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec
from moerun.moe.dispatch import Dispatcher, LocalMoE
from moerun.moe.experts import ExpertStore
from moerun.moe.rig import Rig
from moerun.moe.router import route


class NumpyBackend:
    name = "cpu"
    kind = "CPU"

    def __init__(self, spec: ModelSpec):
        self.spec = spec

    # -- weights and buffers
    def begin_loading(self, gguf: GGUFFile) -> None:
        pass

    def finish_loading(self) -> None:
        pass

    def local_moe(self, gguf: GGUFFile, expert_cache_bytes: int,
                  resident: dict[int, list[int]] | None = None) -> LocalMoE:
        """Experts read from the mmap on first use (which ones are resident does not matter)."""
        return LocalMoE(ExpertStore(gguf, self.spec, expert_cache_bytes))

    def gpu_parent(self) -> None:
        return None

    def dispatcher(self, local: LocalMoE, rig: Rig, gguf: GGUFFile, expert_cache_bytes: int) -> Dispatcher:
        """The MoE step with daemons, on this backend's arrays as they are."""
        return Dispatcher(local, rig)

    def matrix(self, gguf: GGUFFile, name: str) -> np.ndarray:
        """[N, K] float32; a 1-D tensor becomes one row."""
        values = gguf.dequantize(name)
        return values.reshape(1, -1) if values.ndim == 1 else values

    def vector(self, values: np.ndarray) -> np.ndarray:
        return values

    def embedding(self, gguf: GGUFFile, name: str) -> tuple[GGUFFile, str]:
        return gguf, name

    def run(self, model, ids: np.ndarray, cache: KVCache, all_logits: bool) -> np.ndarray:
        return model.forward_on_device(ids, cache.length + np.arange(len(ids)), cache, all_logits)

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.spec, capacity)

    # -- operations
    def embed(self, table: tuple[GGUFFile, str], ids: np.ndarray) -> np.ndarray:
        gguf, name = table
        return gguf.dequantize_rows(name, ids)                                     # [T, H]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return rms_norm(x, weight, self.spec.rms_eps)

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None,
               residual: np.ndarray | None = None) -> np.ndarray:
        """x [T, K] · weight [N, K]ᵀ (+ bias [N]) (+ residual [T, N])"""
        y = x @ weight.T
        if bias is not None:
            y = y + bias
        return y if residual is None else residual + y

    def rope_append(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm: np.ndarray | None,
                    k_norm: np.ndarray | None, cache: KVCache, layer: int, positions: np.ndarray) -> np.ndarray:
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

    def attention(self, q: np.ndarray, cache: KVCache, layer: int, positions: np.ndarray) -> np.ndarray:
        """q [T, NH, D] over cache rows 0..positions[-1] -> [T, NH*Dv]"""
        keys, values = cache.rows(layer, int(positions[-1]) + 1)
        return causal_attention(q, keys, values, int(positions[0]))

    def route(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return route(logits, self.spec.n_experts_used, self.spec.rule.renormalize_topk)

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return silu(gate) * up

    def add(self, x: np.ndarray, y: np.ndarray, gate_logit: np.ndarray | None = None) -> np.ndarray:
        """x + y, or x + sigmoid(gate_logit [T, 1]) · y"""
        return x + (y if gate_logit is None else y * sigmoid(gate_logit))
