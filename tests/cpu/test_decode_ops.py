"""The work of a layer around its products in the kernels (decode.c, attention.c) against
numpy_ops, the float32 reference: rms_norm, the q/k norms with rope and the cache append,
attention over the paged cache (by blocks for a chunk, split positions for a few tokens at long
positions), routing. Random inputs, odd sizes, strided rows, both rope styles, GQA, positions
across a page boundary of the cache, ties in the routing."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moerun.backends import numpy_backend
from moerun.backends.numpy_backend import PAGE_TOKENS, NumpyBackend
from moerun.backends.numpy_ops import rms_norm, route
from moerun.models.spec import ArchRule
from tests.support.gpu import small_spec

NORM_STYLE = ArchRule(family="mixtral", gguf_arch="llama", rope_style="norm", renormalize_topk=True)


def reference_backend(spec, monkeypatch) -> NumpyBackend:
    """A backend that computes every operation with numpy_ops, as where the kernels cannot be had."""
    with monkeypatch.context() as patch:
        patch.setattr(numpy_backend, "load_kernels", lambda: None)
        return NumpyBackend(spec)


def wide_rows(rng, rows: int, cols: int) -> np.ndarray:
    """[rows, cols] random floats, the middle columns of a wider array (rows strided)."""
    return rng.standard_normal((rows, cols + 5), dtype=np.float32)[:, 2:cols + 2]


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("n", [1, 7, 67, 2048])
def test_rms_norm(kernels, rows, n):
    rng = np.random.default_rng(n + rows)
    x = wide_rows(rng, rows, n) * 3
    weight = rng.standard_normal(n, dtype=np.float32)
    got = kernels.rms_norm(x, weight, 1e-6)
    np.testing.assert_allclose(got, rms_norm(x, weight, 1e-6), rtol=2e-6, atol=2e-6)


# NH, NKV, D, Dv: plain multi-head, GQA, one kv head, an odd D/2 and Dv unlike D
HEADS = [(4, 4, 64, 64), (8, 2, 128, 128), (6, 1, 18, 18), (6, 3, 18, 10)]
# chunks through the cache: a prefill chunk, decode steps across the first page boundary (the
# cache grows and moves there), a few tokens at once, a second prefill chunk after them
CHUNKS = [PAGE_TOKENS - 6, 5, 1, 1, 3, 1, 8, 37]


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("rope_style", ["neox", "norm"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_norm"])
def test_rope_append_and_attention(kernels, monkeypatch, heads, rope_style, qk_norm):
    n_heads, n_kv, dim, dim_v = heads
    rule = small_spec().rule if rope_style == "neox" else NORM_STYLE
    spec = dataclasses.replace(small_spec(), rule=rule, n_heads=n_heads, n_kv_heads=n_kv, head_dim_k=dim,
                               head_dim_v=dim_v, rope_base=1e6, n_layers=2)
    rng = np.random.default_rng(n_heads * dim + qk_norm)
    q_norm, k_norm = (rng.uniform(0.5, 1.5, dim).astype(np.float32) for _ in range(2)) if qk_norm else (None, None)
    backends = [NumpyBackend(spec), reference_backend(spec, monkeypatch)]
    caches = [backend.new_cache(2 * PAGE_TOKENS) for backend in backends]
    widths = np.cumsum([n_heads * dim, n_kv * dim, n_kv * dim_v])
    for n_tokens in CHUNKS:
        fused = rng.standard_normal((n_tokens, widths[-1]), dtype=np.float32)          # [T, q + k + v]
        q, k, v = np.split(fused, widths[:-1], axis=1)                                  # column views
        positions = caches[0].length + np.arange(n_tokens)
        outputs = []
        for backend, cache in zip(backends, caches):
            cache.reserve(n_tokens)
            rotated = backend.rope_append(q, k, v, q_norm, k_norm, cache, 1, positions)
            outputs.append((rotated, backend.attention(rotated, cache, 1, positions)))
            cache.advance(n_tokens)
        (got_q, got), (want_q, want) = outputs
        np.testing.assert_allclose(got_q, want_q, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for got_rows, want_rows in zip(caches[0].rows(1, caches[0].length), caches[1].rows(1, caches[1].length)):
        np.testing.assert_allclose(got_rows, want_rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("n_tokens", [1, 3, 15, 40])
def test_attention_of_a_few_tokens_at_long_positions(kernels, monkeypatch, threads, n_tokens):
    """A few tokens after 1500 positions, one kv head: with several threads each token's positions
    are split in equal shares (4 threads, one token: 5 of 301 positions; three tokens: 3 shares
    each), whose parts are merged; one thread takes them whole. 40 tokens go as a prefill chunk,
    by blocks over the cache packed in pieces of 512 rows, 256 positions a pass (the last pass
    narrower), on every instruction set."""
    spec = dataclasses.replace(small_spec(), n_heads=8, n_kv_heads=1, head_dim_k=64, head_dim_v=48, n_layers=1)
    rng = np.random.default_rng(n_tokens)
    backends = [NumpyBackend(spec, threads), reference_backend(spec, monkeypatch)]
    start = 1500
    keys = rng.standard_normal((start + n_tokens, 1, 64), dtype=np.float32)
    values = rng.standard_normal((start + n_tokens, 1, 48), dtype=np.float32)
    q = rng.standard_normal((n_tokens, 8, 64), dtype=np.float32) * 2
    caches = []
    for backend in backends:
        cache = backend.new_cache(start + n_tokens)
        cache.reserve(start + n_tokens)
        cache.append(0, keys, values)
        caches.append(cache)
    want = backends[1].attention(q, caches[1], 0, np.arange(start, start + n_tokens))
    for isa in kernels.isas():
        kernels.use_isa(isa)
        got = backends[0].attention(q, caches[0], 0, np.arange(start, start + n_tokens))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=isa)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("n_tokens, hidden, experts, top_k", [(1, 2048, 128, 8), (3, 67, 60, 4), (8, 16, 9, 1),
                                                               (5, 33, 7, 7)])
def test_route(kernels, monkeypatch, renormalize, n_tokens, hidden, experts, top_k):
    rule = dataclasses.replace(small_spec().rule, renormalize_topk=renormalize)
    spec = dataclasses.replace(small_spec(hidden, experts, top_k), rule=rule)
    rng = np.random.default_rng(hidden + experts)
    x = rng.standard_normal((n_tokens, hidden), dtype=np.float32)
    norm = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    router = rng.standard_normal((experts, hidden), dtype=np.float32) / np.sqrt(hidden)
    h, ids, weights = NumpyBackend(spec).route(x, norm, router)
    want_h, want_ids, want_weights = reference_backend(spec, monkeypatch).route(x, norm, router)
    np.testing.assert_allclose(h, want_h, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-5, atol=1e-7)
    assert ids.dtype == np.int64 and weights.dtype == np.float32


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_ties_go_to_the_lower_id(kernels, renormalize):
    """Through an identity router the logits are h itself, so equal values of h tie exactly."""
    rule = dataclasses.replace(small_spec().rule, renormalize_topk=renormalize)
    spec = dataclasses.replace(small_spec(16, 16, 5), rule=rule)
    x = np.array([[1, 3, 2, 3, 0, 3, 1, 1, 2, 0, 0, 0, 2, 0, 0, 0],
                  [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]], np.float32)
    h, ids, weights = NumpyBackend(spec).route(x, np.ones(16, np.float32), np.eye(16, dtype=np.float32))
    want_ids, want_weights = route(h, 5, renormalize)
    assert ids.tolist() == [[1, 3, 5, 2, 8], [0, 1, 2, 3, 4]] == want_ids.tolist()
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6)
