"""The blocks an architecture (one file each beside this one) composes its layers from, over the
backend's operations (moerun.backends.protocol.Backend): the attention variants, the gated
DeltaNet, the dense FFN and the MoE block. Each takes the layer's input x [T, H] and returns x
plus the block's output, the residual added by the block's last operation.

Shape legend: T tokens, H hidden, NH/NKV heads, D head dim (Dv of values), K experts per token,
HV value heads of DV (DeltaNet).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moerun.models.layer_weights import LayerWeights
from moerun.models.spec import ModelSpec


@dataclass(frozen=True)
class Segment:
    """One sequence's tokens in a step: rows [rows.start, rows.stop) of the step's, their positions
    and the sequence's KV cache (and DeltaNet states); `among` [T, T] bool, where the tokens are a
    speculative tree's nodes, which of them each one attends to (its ancestors and itself)."""
    cache: Any
    positions: Any
    rows: slice
    among: Any = None


@dataclass(frozen=True)
class Step:
    """What a layer computes with during one step: the backend, the spec, the executor of the
    routed experts (moerun.moe.executor.ExpertExecutor), the routing counter of `moerun profile`
    (None unless profiling), and the step's sequences, one segment each (several in a batched
    step: everything but attention and the DeltaNet's recurrence takes their tokens together).
    models/ sits below the backends and moe/ and imports neither: their objects come in here."""
    backend: Any
    spec: ModelSpec
    executor: Any
    routing: Any
    segments: tuple[Segment, ...]

    def per_sequence(self, compute: Callable[[Segment, tuple[Any, ...]], Any], *arrays: Any) -> Any:
        """compute(segment, its rows of each of `arrays`) for each sequence, their outputs' rows
        in the step's order (one sequence: the arrays whole)."""
        if len(self.segments) == 1:
            return compute(self.segments[0], arrays)
        return self.backend.concat([compute(segment, tuple(a[segment.rows] for a in arrays))
                                    for segment in self.segments])


# attention

def attention(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    """Rope over q and k, normalised per head first where the layer has attn_q_norm/attn_k_norm
    of one head [D], then attention over the cache and the output projection."""
    q, k, v = _qkv(step, w, x)
    attended = _rope_attend(step, i, q, k, v, w.attn_q_norm, w.attn_k_norm)
    return step.backend.linear(attended, w.attn_output, residual=x)                  # [T, H]


def whole_projection_qk_norm_attention(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    """Attention whose q/k RMSNorm spans the whole projection ([NH*D] and [NKV*D]) before rope."""
    backend = step.backend
    q, k, v = _qkv(step, w, x)
    q, k = backend.rms_norm(q, w.attn_q_norm), backend.rms_norm(k, w.attn_k_norm)
    attended = _rope_attend(step, i, q, k, v, None, None)
    return backend.linear(attended, w.attn_output, residual=x)                       # [T, H]


def gated_attention(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    """attn_q gives each head's query and an output gate: attention as above (per-head q/k
    norm, rope over spec.rotary_dims of a head), its output scaled by sigmoid(gate)."""
    backend = step.backend
    q_gate, k, v = _qkv(step, w, x)
    q, gate = backend.query_gate(q_gate)                                              # [T, NH*D] each
    attended = _rope_attend(step, i, q, k, v, w.attn_q_norm, w.attn_k_norm)
    return backend.linear(backend.sigmoid_gate(attended, gate), w.attn_output, residual=x)   # [T, H]


def _qkv(step: Step, w: LayerWeights, x: Any) -> tuple[Any, Any, Any]:
    """q [T, NH*D], k [T, NKV*D], v [T, NKV*Dv] of rms_norm(x, attn_norm), with the biases where
    the layer has them: three linears, or one over the fused attn_qkv cut into column views (rows
    strided when T > 1; the backends take them so)."""
    backend, spec = step.backend, step.spec
    if w.attn_qkv is None:
        return backend.linears(x, (w.attn_q, w.attn_k, w.attn_v), (w.attn_q_bias, w.attn_k_bias, w.attn_v_bias),
                               w.attn_norm)
    qkv, = backend.linears(x, (w.attn_qkv,), (w.attn_qkv_bias,), w.attn_norm)         # [T, q + k + v]
    q_end = spec.n_heads * spec.head_dim_k
    k_end = q_end + spec.n_kv_heads * spec.head_dim_k
    return qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]


def _rope_attend(step: Step, i: int, q: Any, k: Any, v: Any, q_norm: Any, k_norm: Any) -> Any:
    """k and v into layer i's cache at the step's positions (k normalised per head by k_norm
    and roped), q likewise, then attention over the cache -> [T, NH*Dv]."""
    backend = step.backend

    def attend(segment: Segment, qkv: tuple[Any, Any, Any]) -> Any:
        roped = backend.rope_append(*qkv, q_norm, k_norm, segment.cache, i, segment.positions)   # [T, NH, D]
        if segment.among is not None:
            return backend.tree_attention(roped, segment.cache, i, segment.among)
        return backend.attention(roped, segment.cache, i, segment.positions)

    return step.per_sequence(attend, q, k, v)


# linear attention

def delta_net(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    """A gated DeltaNet (linear attention) layer: its four projections of rms_norm(x), the
    recurrence over the layer's states, the output projection plus the residual."""
    backend, d = step.backend, w.delta_net
    channels, z, beta, alpha = backend.linears(x, (d.attn_qkv, d.attn_gate, d.ssm_beta, d.ssm_alpha),
                                               (None,) * 4, w.attn_norm)
    weights = (d.ssm_conv1d, d.ssm_a, d.ssm_dt, d.ssm_norm)
    mixed = step.per_sequence(lambda segment, inputs: backend.delta_net(*inputs, weights, segment.cache, i),
                              channels, z, beta, alpha)                               # [T, HV*DV]
    return backend.linear(mixed, d.ssm_out, residual=x)                               # [T, H]


# feed-forward

def dense_ffn(step: Step, w: LayerWeights, x: Any) -> Any:
    """A dense layer's SwiGLU FFN of rms_norm(x, ffn_norm)."""
    h = step.backend.rms_norm(x, w.ffn_norm)
    return step.backend.swiglu_ffn(h, w.ffn_dense, residual=x)                       # [T, H]


def feed_forward(step: Step, i: int, w: LayerWeights, x: Any, experts: Callable[..., Any]) -> Any:
    """Layer i's feed-forward block: the MoE block `experts` (routed_experts or
    routed_and_shared_experts) where the layer has routed experts, else the dense FFN."""
    return experts(step, i, w, x) if step.spec.moe_layers[i] else dense_ffn(step, w, x)


def routed_experts(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    """The K experts the router picks for each token, their outputs weighted by the router's
    top-K weights (renormalised or not: spec.rule), through the executor; the experts' last
    kernel adds the residual."""
    h, ids, weights = _route(step, i, w, x)
    return step.executor.begin(i, h, ids, weights, residual=x).finish()              # [T, H]


def routed_and_shared_experts(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    """The routed experts plus a shared expert every token takes, scaled by
    sigmoid(ffn_gate_inp_shexp · h) where the layer has that gate; the shared expert runs while
    the routed experts' cold work is on its way to the daemons."""
    backend = step.backend
    h, ids, weights = _route(step, i, w, x)
    pending = step.executor.begin(i, h, ids, weights, residual=x)
    shared = backend.swiglu_ffn(h, w.ffn_shexp)                                        # [T, H]
    gate = None if w.ffn_gate_inp_shexp is None else backend.linear(h, w.ffn_gate_inp_shexp)   # [T, 1]
    return backend.add(pending.finish(), shared, gate)


def _route(step: Step, i: int, w: LayerWeights, x: Any) -> tuple[Any, Any, Any]:
    """h = rms_norm(x, ffn_norm) [T, H], the router's top-K ids [T, K] and weights [T, K];
    counted when profiling."""
    h, ids, weights = step.backend.route(x, w.ffn_norm, w.ffn_gate_inp)
    if step.routing is not None:
        step.routing.add(i, step.backend.to_host(ids))
    return h, ids, weights
