"""The CPU's gated delta rule (moerun.backends.numpy_ops.gated_delta_rule: one token as a step,
more in chunks) against a reference written here that takes one token at a time, float32 both:
realistic decays with heads that forget at once (decay -20) or never (decay 0), token counts
below, at and between multiples of the chunk, value heads sharing key heads, and the state
carried from one call to the next.

Shape legend: T tokens, HV value heads, HK key heads, DK key dim, DV value dim, C chunk.
"""
from __future__ import annotations

import numpy as np
import pytest

from moerun.backends.numpy_ops import gated_delta_rule, l2_norm, sigmoid, softplus

TOLERANCE = 1e-5  # of the largest output or state entry

# T, HV, HK, DK, DV, C
SHAPES = [
    (1, 4, 2, 16, 16, 8),
    (2, 4, 2, 16, 16, 8),
    (5, 6, 2, 16, 24, 8),
    (8, 4, 4, 8, 8, 8),
    (19, 8, 4, 16, 8, 8),
    (77, 6, 3, 32, 32, 32),
    (96, 4, 1, 16, 16, 32),
]


def reference(q, k, v, decay, beta, state):
    """Token after token, per value head h (key head h % HK): S ← e^decay S; δ = beta (v - Sᵀk);
    S ← S + k δᵀ; o = Sᵀq / sqrt(DK). q, k [T, HK, DK], v [T, HV, DV], decay and beta [T, HV],
    state [HV, DK, DV] updated in place -> [T, HV, DV]."""
    key_head = np.arange(v.shape[1]) % q.shape[1]
    out = np.empty_like(v)
    for t in range(len(v)):
        for h, g in enumerate(key_head):
            state[h] *= np.exp(decay[t, h])
            delta = beta[t, h] * (v[t, h] - state[h].T @ k[t, g])                  # [DV]
            state[h] += np.outer(k[t, g], delta)
            out[t, h] = state[h].T @ q[t, g] / np.sqrt(np.float32(q.shape[2]))
    return out


def inputs(n_tokens, value_heads, key_heads, key_dim, value_dim, seed):
    """q, k [T, HK, DK] of unit norm, v [T, HV, DV], decay and beta [T, HV], a state [HV, DK, DV].
    decay = -softplus(alpha + dt) · a as the layers make it, but the first head's is -20 (all
    forgotten each token) and the second's 0 (nothing forgotten)."""
    rng = np.random.default_rng(seed)
    q, k = (l2_norm(rng.standard_normal((n_tokens, key_heads, key_dim)).astype(np.float32), 1e-6) for _ in range(2))
    v = rng.standard_normal((n_tokens, value_heads, value_dim)).astype(np.float32)
    a = np.exp(rng.uniform(-3, 1.5, value_heads)).astype(np.float32)
    decay = -softplus(rng.normal(0, 2, (n_tokens, value_heads)).astype(np.float32)) * a
    decay[:, 0], decay[:, 1] = -20, 0
    beta = sigmoid(rng.normal(0, 2, (n_tokens, value_heads)).astype(np.float32))
    state = (0.5 * rng.standard_normal((value_heads, key_dim, value_dim))).astype(np.float32)
    return q, k, v, decay, beta, state


def assert_close(got, want):
    assert got.dtype == np.float32
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-HV{}-HK{}-DK{}-DV{}-C{}".format(*s))
def test_against_token_steps(shape):
    *dims, chunk = shape
    q, k, v, decay, beta, state = inputs(*dims, seed=sum(shape))
    want_state = state.copy()
    want = reference(q, k, v, decay, beta, want_state)
    got = gated_delta_rule(q, k, v, decay, beta, state, chunk=chunk)
    assert got.shape == v.shape
    assert_close(got, want)
    assert_close(state, want_state)


@pytest.mark.parametrize("split", [1, 2, 7, 16, 17, 40, 49])
def test_state_carried_between_calls(split):
    """Two calls in a row, the second taking the state the first left, equal one over both."""
    q, k, v, decay, beta, state = inputs(50, 8, 2, 16, 16, seed=split)
    whole_state = state.copy()
    whole = gated_delta_rule(q, k, v, decay, beta, whole_state, chunk=16)
    first = gated_delta_rule(q[:split], k[:split], v[:split], decay[:split], beta[:split], state, chunk=16)
    second = gated_delta_rule(q[split:], k[split:], v[split:], decay[split:], beta[split:], state, chunk=16)
    assert_close(np.concatenate([first, second]), whole)
    assert_close(state, whole_state)


def test_default_chunk_at_the_layer_shape():
    """The chunk the forward pass uses, at 32 value heads over 16 key heads of 128, over more
    tokens than one chunk and not a multiple of it."""
    q, k, v, decay, beta, state = inputs(45, 32, 16, 128, 128, seed=3)
    want_state = state.copy()
    want = reference(q, k, v, decay, beta, want_state)
    assert_close(gated_delta_rule(q, k, v, decay, beta, state), want)
    assert_close(state, want_state)
