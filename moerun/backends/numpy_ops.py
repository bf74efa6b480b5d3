"""Reference numpy kernels, float32 throughout: norms, rope, attention, top-K routing, the
grouped expert FFN, and the gated DeltaNet of hybrid models.

Shape legend: T tokens in the chunk, S cached positions, H hidden size,
NH query heads, NKV key/value heads, D head dim, F FFN width, E experts, K experts per token,
P routed pairs; DeltaNet: C convolved channels, W conv kernel, HK/HV key/value heads, DK/DV their dims.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

ExpertWeights = tuple[np.ndarray, np.ndarray, np.ndarray]  # gate [F, H], up [F, H], down [H, F]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [..., N], weight [N] -> [..., N]"""
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(variance + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return shifted / np.sum(shifted, axis=axis, keepdims=True)


def swiglu_ffn(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """x [T, H], gate/up [F, H], down [H, F] -> [T, H]"""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def rope_frequencies(dim: int, base: float) -> np.ndarray:
    """The rotation rate of each of the dim/2 pairs, float64 [dim/2]."""
    return base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)


def rope_tables(positions: np.ndarray, dim: int, base: float, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """positions [T] -> cos, sin [T, dim/2], computed in float64 then rounded once."""
    angles = (positions.astype(np.float64) / scale)[:, None] * rope_frequencies(dim, base)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """x [T, heads, D]; cos/sin [T, R/2] for the first R dims of each head (the rest pass as
    they are). "neox" rotates the two halves of R, "norm" rotates adjacent pairs (2i, 2i+1)."""
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return np.concatenate([apply_rope(x[..., :rotated], cos, sin, style), x[..., rotated:]], axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    if style == "neox":
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int,
                     among: np.ndarray | None = None) -> np.ndarray:
    """Grouped-query attention of a chunk over the cache.

    q [T, NH, D] at positions start..start+T-1; k [S, NKV, D], v [S, NKV, Dv] with
    S = start + T; query head h reads kv head h // (NH / NKV). Returns [T, NH * Dv].
    `among` [T, T] bool: which of the chunk's own rows each query sees besides every row before
    the chunk (a speculative tree's ancestors and itself); default: those up to its own.
    """
    n_tokens, n_heads, head_dim = q.shape
    n_cached, n_kv = k.shape[:2]
    group = n_heads // n_kv
    qg = q.reshape(n_tokens, n_kv, group, head_dim).transpose(1, 2, 0, 3)     # [NKV, G, T, D]
    kt = k.transpose(1, 2, 0)[:, None]                                          # [NKV, 1, D, S]
    scores = (qg @ kt) * np.float32(1.0 / np.sqrt(head_dim))                    # [NKV, G, T, S]
    if among is None:
        hidden = np.arange(n_cached)[None, :] > start + np.arange(n_tokens)[:, None]   # [T, S]
    else:
        hidden = np.zeros((n_tokens, n_cached), bool)
        hidden[:, start:] = ~among
    scores = np.where(hidden, np.float32(-np.inf), scores)
    probs = softmax(scores, axis=-1)
    out = probs @ v.transpose(1, 0, 2)[:, None]                                 # [NKV, G, T, Dv]
    return out.transpose(2, 0, 1, 3).reshape(n_tokens, -1)


def route(router_logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-K expert selection as llama.cpp does it: router_logits [T, E] -> expert ids [T, K]
    (int64, best first), weights [T, K] f32. Softmax over all E experts, keep the K most
    probable; `renormalize` rescales the kept weights to sum to 1 (qwen3moe, Mixtral),
    otherwise they are the raw probabilities (qwen2moe, olmoe)."""
    probs = softmax(router_logits.astype(np.float32), axis=-1)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if renormalize:
        weights = weights / np.sum(weights, axis=-1, keepdims=True)
    return ids, weights.astype(np.float32)


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


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), x itself past 20 (as torch and ggml)."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x [..., N] / sqrt(Σ x² + eps)"""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def causal_conv(u: np.ndarray, weight: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal convolution then silu: u [T, C] after the W-1 earlier inputs in state
    [W-1, C]; weight [C, W] (its last column meets the current input) -> ([T, C], the new state)."""
    width = weight.shape[1]
    window = np.concatenate([state, u])                                      # [W-1+T, C]
    out = np.zeros_like(u)
    for i in range(width):
        out += window[i:i + len(u)] * weight[:, i]
    return silu(out), window[len(window) - (width - 1):].copy()


DELTA_CHUNK = 32  # tokens a chunk of the gated delta rule at most: the fastest of 16 to 128 (docs/benchmarks.md)


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray, beta: np.ndarray,
                     state: np.ndarray, chunk: int = DELTA_CHUNK) -> np.ndarray:
    """The gated delta rule: per value head h (reading key head h % HK), token after token,
    S ← e^decay · S; S ← S + k (beta · (v - Sᵀk))ᵀ; o = Sᵀq / sqrt(DK). q, k [T, HK, DK] (unit
    norm), v [T, HV, DV], decay (<= 0) and beta [T, HV]; state [HV, DK, DV], updated in place
    -> o [T, HV, DV].

    One token (a decode step) takes one step of the recurrence (`delta_rule_token`); two or more
    go in ⌈T / chunk⌉ chunks of near-equal size, each in closed form (`delta_rule_chunk`): a few
    matrix products a chunk instead of passes over the whole state a token. A chunk of one token
    is slower than the step (numpy multiplies the outer product of its state update slowly),
    hence the rule, and a split that leaves no such chunk."""
    if len(v) == 1:
        return delta_rule_token(q[0], k[0], v[0], decay[0], beta[0], state)[None]
    pieces = -(-len(v) // chunk)
    parts = zip(*(np.array_split(x, pieces) for x in (q, k, v, decay, beta)))
    return np.concatenate([delta_rule_chunk(*part, state) for part in parts])


def delta_rule_token(q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray, beta: np.ndarray,
                     state: np.ndarray) -> np.ndarray:
    """One token of the gated delta rule: q, k [HK, DK], v [HV, DV], decay and beta [HV];
    state [HV, DK, DV], updated in place -> o [HV, DV]."""
    n_value_heads, key_dim = state.shape[0], state.shape[1]
    key_head = np.arange(n_value_heads) % len(q)
    qh, kh = q[key_head], k[key_head]                                          # [HV, DK]
    state *= np.exp(decay)[:, None, None]
    delta = beta[:, None] * (v - np.einsum("hk,hkv->hv", kh, state))            # [HV, DV]
    state += kh[:, :, None] * delta[:, None, :]
    return np.einsum("hk,hkv->hv", qh, state) * np.float32(1.0 / np.sqrt(key_dim))


def delta_rule_chunk(q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray, beta: np.ndarray,
                     state: np.ndarray) -> np.ndarray:
    """C tokens of the gated delta rule at once (the WY form of chunk_gated_delta_rule in
    flash-linear-attention). With S₀ the state before the chunk, g the cumulative decays and
    Γ[t, s] = e^(g_t - g_s) for s <= t, the state after token t is
    S_t = e^g_t S₀ + Σ_{s<=t} Γ[t, s] k_s δ_sᵀ, so the updates δ [C, DV] solve
    (I + A) δ = diag(β) (V - diag(e^g) K S₀), A[t, s] = β_t Γ[t, s] k_t·k_s strictly below the
    diagonal; then o_t = (e^g_t S₀ᵀq_t + Σ_{s<=t} Γ[t, s] (q_t·k_s) δ_s) / sqrt(DK).
    q, k [C, HK, DK], v [C, HV, DV], decay and beta [C, HV]; state [HV, DK, DV], updated in
    place -> o [C, HV, DV]."""
    n_tokens, n_value_heads = beta.shape
    key_dim = state.shape[1]
    key_head = np.arange(n_value_heads) % q.shape[1]
    qh, kh = q.transpose(1, 0, 2), k.transpose(1, 0, 2)                         # [HK, C, DK]
    keys = kh[key_head]                                                          # [HV, C, DK]
    scores = (qh @ kh.transpose(0, 2, 1))[key_head]                              # [HV, C, C] q_t·k_s
    overlaps = (kh @ kh.transpose(0, 2, 1))[key_head]                            # [HV, C, C] k_t·k_s
    # The decays summed in float64: e^(g_t - g_s) of two long sums loses digits in float32.
    g = np.cumsum(decay.T, axis=1, dtype=np.float64)                             # [HV, C]
    causal = np.tril(np.ones((n_tokens, n_tokens), bool))
    exponents = np.where(causal, g[:, :, None] - g[:, None, :], -np.inf)        # [HV, C, C]
    gaps = np.exp(exponents.astype(np.float32))                                  # [HV, C, C] Γ
    decayed = np.exp(g).astype(np.float32)                                       # [HV, C] e^g_t
    to_end = np.exp(g[:, -1:] - g).astype(np.float32)                            # [HV, C] e^(g_C - g_t)
    b = beta.T                                                                   # [HV, C]
    inverse = unit_lower_inverse(np.tril(overlaps * gaps, -1) * b[:, :, None])   # [HV, C, C] (I + A)⁻¹
    from_values = inverse @ (v.transpose(1, 0, 2) * b[:, :, None])               # [HV, C, DV]
    from_state = inverse @ (keys * (b * decayed)[:, :, None])                    # [HV, C, DK]
    delta = from_values - from_state @ state                                     # [HV, C, DV]
    out = decayed[:, :, None] * (qh[key_head] @ state) + (scores * gaps) @ delta  # [HV, C, DV]
    state *= decayed[:, -1, None, None]
    state += (keys * to_end[:, :, None]).transpose(0, 2, 1) @ delta
    return out.transpose(1, 0, 2) * np.float32(1.0 / np.sqrt(key_dim))


def unit_lower_inverse(a: np.ndarray) -> np.ndarray:
    """(I + a)⁻¹ of a [..., C, C] strictly lower triangular, by forward substitution a row at a
    time (a is overwritten)."""
    inverse = np.negative(a, out=a)
    for i in range(1, a.shape[-1]):
        inverse[..., i:i + 1, :i] += inverse[..., i:i + 1, :i] @ inverse[..., :i, :i]
    inverse += np.eye(a.shape[-1], dtype=a.dtype)
    return inverse
