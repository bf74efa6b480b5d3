"""The blocking of products at many tokens (work.h: panels of rows dequantized once, chunks of
a row's values per pass) changes where the data sits in the caches, never the results: every
panel size and chunk gives the bits of the fused tile one token at a time, on every
instruction set, for rows of every length (a row's last values past its full vectors
included). A matrix unit (amx) sums in another order: every blocking gives its own bits, within
float32 rounding of the fused tile's."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from moerun.backends.cpu.library import Matrix
from tests.support.stored import T, random_stored, row_bytes

BLOCKINGS = [(4, 0), (8, 16), (16, 48), (20, 64), (64, 256), (256, 0), (0, 0)]    # panel rows, chunk; 0: default
CASES = [(T.Q4_K, 70, 512), (T.Q6_K, 33, 256), (T.Q8_0, 50, 96), (T.F32, 23, 67), (T.F16, 17, 160)]  # type, N, n


@pytest.fixture
def set_blocking(kernels):
    def blocking(rows: int, chunk: int) -> None:
        kernels.lib.moe_set_blocking(ctypes.c_int64(rows), ctypes.c_int64(chunk))
    yield blocking
    blocking(0, 0)


def sizes(kernels, cols: int, rows: int, threads: int) -> tuple[int, int]:
    panel, chunk = ctypes.c_int64(), ctypes.c_int64()
    kernels.lib.moe_blocking(ctypes.c_int64(cols), ctypes.c_int64(rows), ctypes.c_int(threads), ctypes.byref(panel),
                             ctypes.byref(chunk))
    return panel.value, chunk.value


@pytest.mark.parametrize("ggml_type,rows,cols", CASES, ids=lambda case: getattr(case, "name", str(case)))
def test_every_blocking_gives_the_same_bits(kernels, set_blocking, ggml_type, rows, cols):
    rng = np.random.default_rng(int(ggml_type) + rows)
    raw = random_stored(ggml_type, rows, cols, rng)        # kept alive: the struct points into it
    stored = [Matrix(raw.ctypes.data, int(ggml_type), rows, cols, row_bytes(ggml_type, cols), 0)]
    x = rng.normal(size=(29, cols)).astype(np.float32)
    for isa in kernels.isas():
        kernels.use_isa(isa)
        one_at_a_time = np.concatenate([kernels.matmul(stored, x[t:t + 1], threads=1) for t in range(len(x))])
        if kernels.unit_tokens and cols % 32 == 0:
            on_unit = kernels.matmul(stored, x, threads=1)
            assert np.linalg.norm(on_unit - one_at_a_time) <= 2e-6 * np.linalg.norm(one_at_a_time), isa
            one_at_a_time = on_unit
        for panel, chunk in BLOCKINGS:
            set_blocking(panel, chunk)
            for threads in (1, 3):
                np.testing.assert_array_equal(kernels.matmul(stored, x, threads=threads), one_at_a_time,
                                              err_msg=f"{isa}, panel {panel}, chunk {chunk}, {threads} threads")


def test_sizes_come_from_the_caches_unless_set(kernels, set_blocking):
    panel, chunk = sizes(kernels, 2048, 4096, 2)
    assert 16 <= panel <= 256 and panel % 16 == 0 and chunk in (2048, 1024, 512)   # whole rows or as measured
    assert sizes(kernels, 2048, 4096, 64)[0] == 16                         # at least PANELS_PER_THREAD tasks a thread
    assert sizes(kernels, 512, 4096, 2)[0] >= panel                        # shorter rows, more of them
    set_blocking(30, 100)
    assert sizes(kernels, 2048, 4096, 2) == (32, 112)                      # whole tiles, chunks of whole vectors
    assert sizes(kernels, 64, 4096, 2) == (32, 64)                         # a chunk past the row: the whole row
