"""KV caches of llama.cpp's cache types on the CPU parent: the kernels' quantizer (quantize.c)
against gguf-py's numpy one (ggml's reference rounding) bit for bit, and attention over caches
of each type, keys and values typed apart, against numpy_ops over the same rows dequantized by
gguf-py: prefill chunks, decode steps across the cache's first page boundary, a few tokens at a
long position split over threads, every instruction set; a snapshot restored as it was."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moerun.backends import numpy_backend
from moerun.backends.kv_types import KV_TYPES, KVTypes, decode, encode, row_bytes
from moerun.backends.numpy_backend import PAGE_TOKENS, NumpyBackend
from tests.support.gpu import small_spec

BLOCK_TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
# (keys, values): each type on both sides, and sides of different types
TYPE_PAIRS = [(name, name) for name in KV_TYPES if name != "f32"] + [("q8_0", "q4_0"), ("f16", "q5_1"),
                                                                      ("f32", "q8_0")]
CHUNKS = [PAGE_TOKENS - 6, 5, 1, 1, 3, 1, 8, 37]


def reference_backend(spec, types: KVTypes, monkeypatch) -> NumpyBackend:
    """numpy_ops for every operation, the cache's rows encoded and decoded by gguf-py."""
    with monkeypatch.context() as patch:
        patch.setattr(numpy_backend, "load_kernels", lambda: None)
        return NumpyBackend(spec, kv_types=types)


def awkward_rows(rng, rows: int, n: int) -> np.ndarray:
    """[rows, n] floats of many scales, with blocks the rounding finds hard: all zeros, all one
    value, the largest magnitude negative and tied, subnormal halves, values past f16's range."""
    x = rng.standard_normal((rows, n), dtype=np.float32) * np.logspace(-6, 3, rows, dtype=np.float32)[:, None]
    x[0, :32] = 0
    x[1, :32] = 7.0
    x[2, :32] = np.linspace(-1, 1, 32)
    x[2, 5] = x[2, 31] = -3.0
    x[3, 40] = 70000.0
    x[4, :] = np.float32(3e-6) * rng.standard_normal(n, dtype=np.float32)
    x[5, 7] = 0.5 * (1 + 2.0 ** -11)                    # halfway between two halves: to even
    return x


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")   # gguf-py, 70000 to f16
@pytest.mark.parametrize("name", list(KV_TYPES))
def test_the_kernels_round_rows_as_ggml_does(kernels, name):
    x = awkward_rows(np.random.default_rng(len(name)), 48, 256)
    got = kernels.quantize_rows(int(KV_TYPES[name]), x, row_bytes(name, 256))
    want = encode(name, x).view(np.uint8).reshape(got.shape)
    assert np.array_equal(got, want)
    if name != "f32":
        restored = decode(name, got)
        assert 0 < np.abs(restored - x)[6:].max() / np.abs(x[6:]).max() < 0.1      # rounded, not copied


@pytest.mark.parametrize("types", TYPE_PAIRS, ids=lambda t: "-".join(t))
@pytest.mark.parametrize("heads", [(8, 2, 64, 64), (4, 4, 128, 32)], ids=lambda h: "x".join(map(str, h)))
def test_attention_over_a_typed_cache_matches_numpy(kernels, monkeypatch, types, heads):
    n_heads, n_kv, dim, dim_v = heads
    kv_types = KVTypes(*types)
    spec = dataclasses.replace(small_spec(), n_heads=n_heads, n_kv_heads=n_kv, head_dim_k=dim, head_dim_v=dim_v,
                               rope_base=1e6, n_layers=2)
    rng = np.random.default_rng(n_heads * dim)
    backends = [NumpyBackend(spec, kv_types=kv_types), reference_backend(spec, kv_types, monkeypatch)]
    caches = [backend.new_cache(2 * PAGE_TOKENS) for backend in backends]
    widths = np.cumsum([n_heads * dim, n_kv * dim, n_kv * dim_v])
    for n_tokens in CHUNKS:
        q, k, v = np.split(rng.standard_normal((n_tokens, widths[-1]), dtype=np.float32), widths[:-1], axis=1)
        positions = caches[0].length + np.arange(n_tokens)
        outputs = []
        for backend, cache in zip(backends, caches):
            cache.reserve(n_tokens)
            rotated = backend.rope_append(q, k, v, None, None, cache, 1, positions)
            outputs.append(backend.attention(rotated, cache, 1, positions))
            cache.advance(n_tokens)
        np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    (got_k, got_v), (want_k, want_v) = (cache.rows(1, cache.length) for cache in caches)
    assert np.array_equal(got_v, want_v)                       # the same values, rounded the same way
    np.testing.assert_allclose(decode(kv_types.key, got_k), decode(kv_types.key, want_k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["f16", *BLOCK_TYPES])
@pytest.mark.parametrize("n_tokens", [1, 3, 40])
def test_a_few_tokens_at_a_long_position_over_a_typed_cache(kernels, monkeypatch, name, n_tokens):
    """1500 positions of one kv head: a few tokens split over 4 threads' shares, 40 as a prefill
    chunk packed from the typed rows, on every instruction set; against f32 attention over the
    same rows dequantized (the rows' rounding is all that differs from an f32 cache)."""
    spec = dataclasses.replace(small_spec(), n_heads=8, n_kv_heads=1, head_dim_k=64, head_dim_v=64, n_layers=1)
    rng = np.random.default_rng(n_tokens)
    start = 1500
    keys = rng.standard_normal((start + n_tokens, 1, 64), dtype=np.float32)
    values = rng.standard_normal((start + n_tokens, 1, 64), dtype=np.float32)
    q = rng.standard_normal((n_tokens, 8, 64), dtype=np.float32) * 2
    typed, exact = NumpyBackend(spec, 4, KVTypes(name, name)), reference_backend(spec, KVTypes(), monkeypatch)
    caches = []
    for backend, (k, v) in ((typed, (keys, values)),
                            (exact, (decode(name, encode(name, keys)), decode(name, encode(name, values))))):
        cache = backend.new_cache(start + n_tokens)
        cache.reserve(start + n_tokens)
        cache.append(0, k, v)
        caches.append(cache)
    positions = np.arange(start, start + n_tokens)
    want = exact.attention(q, caches[1], 0, positions)
    unrounded = NumpyBackend(spec, 4)
    plain = unrounded.new_cache(start + n_tokens)
    plain.reserve(start + n_tokens)
    plain.append(0, keys, values)
    assert np.abs(unrounded.attention(q, plain, 0, positions) - want).max() > 1e-5    # the rounding shows
    for isa in kernels.isas():
        kernels.use_isa(isa)
        np.testing.assert_allclose(typed.attention(q, caches[0], 0, positions), want, rtol=1e-5, atol=1e-5,
                                   err_msg=isa)


@pytest.mark.parametrize("name", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("start", [0, 4096, 32768, 131071])
@pytest.mark.parametrize("n_tokens", [1, 16])
def test_attention_at_long_contexts_matches_numpy(kernels, monkeypatch, name, start, n_tokens):
    """One token (its positions split over 2 threads) and a prefill chunk of 16 (blocks of 256
    positions a pass) after up to 128k positions of two kv heads, against numpy over the rows as
    the cache holds them."""
    spec = dataclasses.replace(small_spec(), n_heads=4, n_kv_heads=2, head_dim_k=64, head_dim_v=64, n_layers=1)
    rng = np.random.default_rng(start + n_tokens)
    seen = start + n_tokens
    keys = rng.standard_normal((seen, 2, 64), dtype=np.float32)
    values = rng.standard_normal((seen, 2, 64), dtype=np.float32)
    q = rng.standard_normal((n_tokens, 4, 64), dtype=np.float32) * 3
    caches = []
    for backend in (NumpyBackend(spec, 2, KVTypes(name, name)), reference_backend(spec, KVTypes(name, name),
                                                                                   monkeypatch)):
        cache = backend.new_cache(seen)
        cache.reserve(seen)
        cache.append(0, keys, values)
        caches.append((backend, cache))
    positions = np.arange(start, seen)
    got, want = (backend.attention(q, cache, 0, positions) for backend, cache in caches)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_typed_cache_restored_from_its_snapshot_attends_as_before(kernels):
    spec = dataclasses.replace(small_spec(), n_heads=4, n_kv_heads=2, head_dim_k=64, head_dim_v=64, n_layers=1)
    backend = NumpyBackend(spec, kv_types=KVTypes("q8_0", "q4_1"))
    rng = np.random.default_rng(3)
    cache = backend.new_cache(64)
    cache.reserve(20)
    cache.append(0, rng.standard_normal((20, 2, 64), dtype=np.float32),
                 rng.standard_normal((20, 2, 64), dtype=np.float32))
    cache.advance(20)
    state = cache.snapshot()
    assert state.keys[0].dtype == np.uint8 and state.nbytes < 20 * 2 * 64 * 2
    restored = backend.restore_cache(state, 64)
    q = rng.standard_normal((1, 4, 64), dtype=np.float32)
    positions = np.array([19])
    assert np.array_equal(backend.attention(q, restored, 0, positions), backend.attention(q, cache, 0, positions))


def test_block_types_need_whole_blocks_per_head(kernels):
    spec = dataclasses.replace(small_spec(), head_dim_k=48, head_dim_v=48)
    with pytest.raises(ValueError, match="--cache-type-k q8_0: heads of 48 dims are not whole blocks of 32"):
        NumpyBackend(spec, kv_types=KVTypes("q8_0", "f16"))
