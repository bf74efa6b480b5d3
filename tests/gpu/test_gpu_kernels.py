"""Every stored type's products on the GPU against numpy on the dequantized weights,
on fresh random inputs: the decode GEMV (f32, T <= 8), the prefill product (f16
operands, f32 accumulation), the embedding gather and the dequantization itself."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from moerun.backends.gpu_weights import KERNEL_TYPES, DeviceMatrix
from moerun.gguf.quants import dequantize
from moerun.writers.bench_model import BLOCK_FILLERS, random_blocks
from tests.support.gpu import gpu_device, small_spec

pytestmark = pytest.mark.gpu
T = GGMLQuantizationType
ROWS, COLS = 96, 512


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def random_matrix(ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes [ROWS, row bytes] of a random matrix stored as ggml_type."""
    if ggml_type in BLOCK_FILLERS:
        block_size, _ = GGML_QUANT_SIZES[ggml_type]
        return random_blocks(ggml_type, ROWS * COLS // block_size, rng).reshape(ROWS, -1)
    values = rng.normal(0, 0.05, (ROWS, COLS)).astype(np.float32)
    if ggml_type == T.F32:
        return values.view(np.uint8)
    return gguf_quants.quantize(values, ggml_type).view(np.uint8).reshape(ROWS, -1)


@pytest.fixture(scope="module")
def backend():
    from moerun.backends import open_backend
    return open_backend(gpu_device(), small_spec())


@pytest.fixture(params=list(KERNEL_TYPES), ids=[t.name for t in KERNEL_TYPES])
def stored(request, backend):
    ggml_type = request.param
    raw = random_matrix(ggml_type, np.random.default_rng())
    element_views = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}
    view = raw.view(element_views[ggml_type]) if ggml_type in element_views else raw
    reference = dequantize(view, ggml_type).reshape(ROWS, COLS).astype(np.float64)
    matrix = DeviceMatrix(backend.cupy.asarray(raw.reshape(-1)), KERNEL_TYPES[ggml_type], ROWS, COLS)
    return matrix, reference


@pytest.mark.parametrize("n_tokens", [1, 3, 8])
def test_decode_gemv_matches_dequantized_product(backend, stored, n_tokens):
    matrix, reference = stored
    x = np.random.default_rng().normal(size=(n_tokens, COLS)).astype(np.float32)
    residual = np.random.default_rng().normal(size=(n_tokens, ROWS)).astype(np.float32)
    got = backend.linear(backend.cupy.asarray(x), matrix, residual=backend.cupy.asarray(residual)).get()
    assert relative_error(got, x @ reference.T + residual) < 1e-5


def test_prefill_product_matches_dequantized_product(backend, stored):
    matrix, reference = stored
    x = np.random.default_rng().normal(size=(40, COLS)).astype(np.float32)
    got = backend.linear(backend.cupy.asarray(x), matrix).get()
    error = relative_error(got, x @ reference.T)
    assert 0 < error < 2e-3      # f16 operands: rounded, but only that


def test_dequantize_f16_and_gather_rows(backend, stored):
    matrix, reference = stored
    assert np.allclose(backend.dequantize_f16(matrix).get(), reference, rtol=1e-3, atol=1e-7)
    ids = np.random.default_rng().integers(0, ROWS, 5)
    got = backend.embed(matrix, backend.upload_ids(ids)).get()
    assert np.allclose(got, reference[ids], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("skew", [0.05, 1.0, 50.0])
def test_expert_tile_layout(backend, skew):
    """Every routed pair gets its own row among its expert's tiles, holding its token."""
    from moerun.backends.gpu_experts import TILE_ROWS, TileLayout, TileScratch
    rng = np.random.default_rng()
    n_tokens, top_k, n_experts = 300, 4, 16
    p = rng.dirichlet(np.full(n_experts, skew))
    ids = np.stack([rng.choice(n_experts, top_k, replace=False, p=p) for _ in range(n_tokens)]).astype(np.int32)
    layout = TileLayout(backend, backend.cupy.asarray(ids), n_experts, TileScratch(backend.cupy, 64, 64))
    pair_rows, token_rows = layout.pair_rows.get(), layout.token_rows.get()
    tile_expert, tile_row = layout.tile_expert.get(), layout.tile_row.get()
    assert np.array_equal(layout.counts.get(), np.bincount(ids.reshape(-1), minlength=n_experts))
    assert len(set(pair_rows.tolist())) == ids.size
    assert np.array_equal(token_rows[pair_rows], np.arange(ids.size) // top_k)
    assert (token_rows >= 0).sum() == ids.size
    owner = np.full(layout.max_rows, -1)
    for expert, first in zip(tile_expert, tile_row):
        if expert >= 0:
            owner[first:first + TILE_ROWS] = expert
    assert np.array_equal(owner[pair_rows], ids.reshape(-1))
