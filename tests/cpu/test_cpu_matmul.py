"""Every stored type's product, on every instruction set this machine runs, against numpy on
the dequantized weights: odd row counts (not a multiple of the 4-row tile or of the threads),
token counts that leave every remainder of a tile's token blocks, rows whose float elements
do not fill the last vector. Activations stay float32, so the products match to float32
rounding, and results do not depend on the thread count or on how tokens are batched."""
from __future__ import annotations

import platform

import numpy as np
import pytest

from moerun.backends.cpu.library import Matrix
from tests.support.stored import (
    BLOCK_TYPES,
    FLOAT_TYPES,
    KERNEL_TYPES,
    T,
    random_stored,
    row_bytes,
    stored_values,
)

BOUND = 2e-6          # |got - want| / |want| over the whole product (float32 sums of up to 768 terms)
SHAPES = [(37, 256, 1), (5, 512, 13), (130, 768, 7), (9, 96, 3)]     # rows, cols, tokens
ELEMENT_SHAPES = [(6, 67, 5), (3, 9, 2)]                              # float rows of any length


def matrix(raw: np.ndarray, ggml_type: T, rows: int, cols: int) -> Matrix:
    return Matrix(raw.ctypes.data, int(ggml_type), rows, cols, row_bytes(ggml_type, cols), 0)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_this_machine_runs_its_vector_kernels(kernels):
    isas = kernels.isas()
    assert isas[-1] == "scalar" and kernels.isa == isas[0]
    if platform.machine() in ("x86_64", "AMD64"):
        assert "avx2" in isas or "avx2" not in open("/proc/cpuinfo").read()
    if platform.machine() in ("aarch64", "arm64"):
        assert isas[0] == "neon"


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_product_matches_the_dequantized_weights(kernels, ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    shapes = [s for s in SHAPES if s[1] % (256 if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K) else 32) == 0]
    shapes += ELEMENT_SHAPES if ggml_type in FLOAT_TYPES else []
    for rows, cols, tokens in shapes:
        raw = random_stored(ggml_type, rows, cols, rng)
        want_matrix = stored_values(raw, ggml_type).reshape(rows, cols)
        x = rng.normal(size=(tokens, cols)).astype(np.float32)
        want = x.astype(np.float64) @ want_matrix.T
        for isa in kernels.isas():
            kernels.use_isa(isa)
            got = kernels.matmul([matrix(raw, ggml_type, rows, cols)], x, threads=3)
            assert got.shape == (tokens, rows) and got.dtype == np.float32
            error = relative_error(got, want)
            assert error < BOUND, f"{isa} {ggml_type.name} {rows}x{cols}, {tokens} tokens: {error:.1e}"


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantized_values_are_ggml_s(kernels, ggml_type):
    """Times the identity, the product is the weights as the kernels dequantize them: to the
    last bit the values gguf-py's dequantization (the float32 reference) gives."""
    rng = np.random.default_rng(100 + int(ggml_type))
    rows, cols = 8, 256
    raw = random_stored(ggml_type, rows, cols, rng)
    want = stored_values(raw, ggml_type).reshape(rows, cols).astype(np.float32)
    for isa in kernels.isas():
        kernels.use_isa(isa)
        got = kernels.matmul([matrix(raw, ggml_type, rows, cols)], np.eye(cols, dtype=np.float32), threads=2).T
        np.testing.assert_array_equal(got, want, err_msg=f"{isa} {ggml_type.name}")


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_a_matrix_unit_gives_each_token_the_same_bits_in_any_call(kernels, ggml_type):
    """On a matrix unit (amx: from 24 tokens) a token's products do not depend on the threads
    or on which tokens share its call (its rows of a tile are its own), and stay within float32
    rounding of the fused tile's."""
    units = []
    for isa in kernels.isas():
        kernels.use_isa(isa)
        if kernels.unit_tokens:
            units.append(isa)
    if not units:
        pytest.skip(f"no matrix unit here (instruction sets: {', '.join(kernels.isas())})")
    rng = np.random.default_rng(8)
    rows, cols, tokens = 45, 512, 48
    raw = random_stored(ggml_type, rows, cols, rng)
    stored = [matrix(raw, ggml_type, rows, cols)]
    x = rng.normal(size=(tokens, cols)).astype(np.float32)
    for isa in units:
        kernels.use_isa(isa)
        whole = kernels.matmul(stored, x, threads=1)
        np.testing.assert_array_equal(kernels.matmul(stored, x, threads=5), whole, err_msg=isa)
        halves = [kernels.matmul(stored, x[t:t + 24], threads=2) for t in (0, 24)]
        np.testing.assert_array_equal(np.concatenate(halves), whole, err_msg=f"{isa}, 24 at a time")
        fused = np.concatenate([kernels.matmul(stored, x[t:t + 1], threads=1) for t in range(tokens)])
        assert relative_error(whole, fused) < BOUND, isa


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_results_do_not_depend_on_threads_or_batching(kernels, ggml_type):
    """19 tokens at once go through tiles dequantized first; one or a few at a time through the
    fused tiles (at most 12 tokens on any instruction set): the same bits, whatever the threads."""
    rng = np.random.default_rng(7)
    rows, cols, tokens = 45, 2048, 19         # enough work for several threads
    raw = random_stored(ggml_type, rows, cols, rng)           # kept alive: the struct points into it
    stored = [matrix(raw, ggml_type, rows, cols)]
    x = rng.normal(size=(tokens, cols)).astype(np.float32)
    for isa in kernels.isas():
        kernels.use_isa(isa)
        one = kernels.matmul(stored, x, threads=1)
        for threads in (2, 5):
            np.testing.assert_array_equal(kernels.matmul(stored, x, threads=threads), one, err_msg=isa)
        for size in (1, 5):
            batches = [kernels.matmul(stored, x[t:t + size], threads=2) for t in range(0, tokens, size)]
            np.testing.assert_array_equal(np.concatenate(batches), one, err_msg=f"{isa}, {size} at a time")


def test_several_matrices_at_once(kernels):
    """q, k and v (say) in one call: each one's product, side by side, the bits of its own call."""
    rng = np.random.default_rng(9)
    shapes = [(T.Q4_K, 67), (T.Q6_K, 9), (T.Q8_0, 130)]              # type, rows; all 512 columns
    raws = [random_stored(ggml_type, rows, 512, rng) for ggml_type, rows in shapes]
    matrices = [matrix(raw, ggml_type, rows, 512) for raw, (ggml_type, rows) in zip(raws, shapes)]
    for tokens in (1, 3, 17):
        x = rng.normal(size=(tokens, 512)).astype(np.float32)
        want = np.concatenate([kernels.matmul([m], x, threads=1) for m in matrices], axis=1)
        np.testing.assert_array_equal(kernels.matmul(matrices, x, threads=3), want)


def test_refuses_what_it_cannot_read(kernels):
    raw = np.zeros((4, row_bytes(T.Q8_0, 64)), np.uint8)
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="type without CPU kernels"):
        kernels.matmul([Matrix(raw.ctypes.data, int(T.Q2_K), 4, 64, raw.shape[1], 0)], x, threads=1)
    with pytest.raises(ValueError, match="shapes"):
        kernels.matmul([Matrix(raw.ctypes.data, int(T.Q8_0), 4, 64, raw.shape[1] + 2, 0)], x, threads=1)
    with pytest.raises(ValueError, match="shapes"):       # matrices of different widths
        kernels.matmul([matrix(raw, T.Q8_0, 4, 64), matrix(raw, T.Q8_0, 2, 32)], x, threads=1)
    with pytest.raises(ValueError, match="at most 8 matrices"):
        kernels.matmul([matrix(raw, T.Q8_0, 4, 64)] * 9, x, threads=1)
    assert kernels.supports(T.Q6_K) and not kernels.supports(T.IQ4_XS)


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_are_the_stored_values(kernels, ggml_type):
    """moe_rows (a step's token embeddings): each row asked for, in that order and repeats too,
    as gguf.quants dequantizes it, on every instruction set; an id outside the matrix is refused."""
    rng = np.random.default_rng(int(ggml_type))
    rows, cols = (6, 67) if ggml_type in FLOAT_TYPES else (37, 512)
    raw = random_stored(ggml_type, rows, cols, rng)
    want = stored_values(raw, ggml_type).reshape(rows, cols)
    ids = np.array([rows - 1, 0, 3, 3, 1])
    for isa in kernels.isas():
        kernels.use_isa(isa)
        got = kernels.rows(matrix(raw, ggml_type, rows, cols), ids)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want[ids])
    for outside in (rows, -1):
        with pytest.raises(ValueError, match="row"):
            kernels.rows(matrix(raw, ggml_type, rows, cols), np.array([0, outside]))
