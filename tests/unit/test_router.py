"""Top-K routing (moerun.backends.numpy_ops.route) against a reference written here: softmax
in float64, the K most probable experts by sorting, exact ties to the lower expert id.

Ties: the GPU parent's router (route_top_k in moerun/backends/gpu/kernels/layers.cu) also breaks
exact ties to the lower id, so that is the rule both parents must share. llama.cpp itself
leaves the order of exact ties to its backend's sort (the CPU argsort is an exchange sort, not
stable), so no finer agreement with it exists to test.

Shape legend: T tokens, E experts, K experts per token.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moerun.backends.numpy_backend import NumpyBackend
from moerun.backends.numpy_ops import route
from moerun.models.registry import ARCHITECTURES
from tests.support.gpu import small_spec

SHAPES = [(1, 8, 2), (7, 8, 8), (5, 16, 1), (33, 64, 8), (4, 60, 4), (3, 128, 8), (2, 4, 4)]


def reference(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """logits [T, E] -> ids [T, K], weights [T, K] (float64)."""
    ids, weights = [], []
    for row in logits.astype(np.float64):
        probs = np.exp(row - row.max())
        probs /= probs.sum()                                               # [E]
        chosen = sorted(range(len(row)), key=lambda e: (-probs[e], e))[:k]
        picked = probs[chosen]
        ids.append(chosen)
        weights.append(picked / picked.sum() if renormalize else picked)
    return np.array(ids, np.int64).reshape(len(logits), k), np.array(weights).reshape(len(logits), k)


def logits_for(tokens: int, experts: int, seed: int) -> np.ndarray:
    return (2.0 * np.random.default_rng(seed).standard_normal((tokens, experts))).astype(np.float32)  # [T, E]


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("tokens, experts, k", SHAPES)
def test_matches_the_float64_reference(tokens, experts, k, renormalize):
    logits = logits_for(tokens, experts, seed=tokens * 1000 + experts + k)
    ids, weights = route(logits, k, renormalize)
    want_ids, want_weights = reference(logits, k, renormalize)
    assert ids.shape == weights.shape == (tokens, k)
    assert ids.dtype == np.int64 and weights.dtype == np.float32
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("tokens, experts, k", SHAPES)
def test_properties(tokens, experts, k):
    logits = logits_for(tokens, experts, seed=7 + k)
    probs = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)                              # [T, E]
    raw_ids, raw = route(logits, k, renormalize=False)
    norm_ids, norm = route(logits, k, renormalize=True)
    np.testing.assert_array_equal(raw_ids, norm_ids)
    for t in range(tokens):
        assert len(set(raw_ids[t].tolist())) == k                          # distinct experts
        assert np.all((0 <= raw_ids[t]) & (raw_ids[t] < experts))
        assert np.all(np.diff(raw[t]) <= 0)                                # best first
        np.testing.assert_allclose(raw[t], probs[t, raw_ids[t]], rtol=2e-6)
        # nothing left out is more probable than what was kept
        left_out = np.setdiff1d(np.arange(experts), raw_ids[t])
        assert left_out.size == 0 or probs[t, left_out].max() <= probs[t, raw_ids[t]].min()
    np.testing.assert_allclose(norm.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(norm, raw / raw.sum(axis=1, keepdims=True), rtol=1e-6)
    if k == experts:
        np.testing.assert_allclose(raw.sum(axis=1), 1.0, rtol=1e-6)        # all of the mass


def test_k_equal_to_e_is_a_sort_of_every_expert():
    logits = np.array([[0.5, -1.0, 2.0, 1.0]], np.float32)                # [1, 4]
    ids, _ = route(logits, 4, renormalize=False)
    assert ids.tolist() == [[2, 3, 0, 1]]


@pytest.mark.parametrize("row, k, want", [
    ([1.0, 3.0, 3.0, 0.0, 3.0], 2, [1, 2]),
    ([1.0, 3.0, 3.0, 0.0, 3.0], 3, [1, 2, 4]),
    ([1.0, 2.0, 2.0, 3.0], 3, [3, 1, 2]),       # an exchange sort would give [3, 2, 1]
    ([0.0] * 8, 2, [0, 1]),
    ([5.0, 1.0, 5.0, 5.0, 1.0, 1.0], 5, [0, 2, 3, 1, 4]),
])
def test_exact_ties_go_to_the_lower_id(row, k, want):
    ids, weights = route(np.array([row], np.float32), k, renormalize=True)
    assert ids[0].tolist() == want
    _, want_weights = reference(np.array([row]), k, renormalize=True)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6)


def test_large_and_masked_logits_stay_finite():
    logits = np.array([[1000.0, 0.0, -1000.0, 999.0],
                       [-np.inf, 3.0, -np.inf, 2.0]], np.float32)          # [2, 4]
    ids, weights = route(logits, 2, renormalize=False)
    assert np.all(np.isfinite(weights))
    assert ids.tolist() == [[0, 3], [1, 3]]
    np.testing.assert_allclose(weights, reference(logits, 2, renormalize=False)[1], rtol=1e-6)


# llama.cpp's rule per architecture (design brief, section 6): qwen3moe, Mixtral and qwen35moe
# renormalise the kept weights, qwen2moe and olmoe keep the raw probabilities.
RENORMALISES = {"qwen3moe": True, "mixtral": True, "qwen2moe": False, "olmoe": False, "qwen35moe": True}


@pytest.mark.parametrize("gguf_arch", sorted(ARCHITECTURES))
def test_backend_route_uses_the_architecture_rule(gguf_arch):
    rule = ARCHITECTURES[gguf_arch].RULE
    spec = dataclasses.replace(small_spec(experts=16, top_k=4), rule=rule)
    x = logits_for(9, 16, seed=3)                                          # [9, 16]
    norm = np.linspace(0.5, 2, 16, dtype=np.float32)
    h, ids, weights = NumpyBackend(spec).route(x, norm, np.eye(16, dtype=np.float32))    # logits h · Iᵀ = h
    want_h = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + spec.rms_eps) * norm
    np.testing.assert_allclose(h, want_h, rtol=1e-5)
    want_ids, want_weights = reference(h, 4, RENORMALISES[rule.family])
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=2e-6, atol=1e-7)
    assert set(RENORMALISES) == {module.RULE.family for module in ARCHITECTURES.values()}
