"""moe_ffn as one pool job: gate/up tasks, then down tasks that wait for each expert's gate/up
tasks; fewer rows a task where a call has few (a decode step's few experts on many threads).
Whatever the thread count (more threads than this machine's cores included), the rows a task
takes, and whether the pool's workers spun or slept since the last call, every output is the
same bit for bit."""
from __future__ import annotations

import time

import numpy as np
import pytest

from moerun.backends.cpu.library import ExpertMatrices, Matrix
from moerun.backends.numpy_backend import QuantizedExperts
from tests.support.stored import T, random_stored, row_bytes

HIDDEN, FFN, N_EXPERTS = 512, 256, 16      # 4 experts at one token: enough work for 12 threads
POOL_SPIN_S = 0.002                        # SPIN_NS of pool.c: longer gaps find the workers asleep


def layer(kernels, types: tuple[T, T], threads: int) -> QuantizedExperts:
    rng = np.random.default_rng(7)
    stacks = [np.stack([random_stored(kind, rows, cols, rng) for _ in range(N_EXPERTS)])
              for kind, rows, cols in ((types[0], FFN, HIDDEN), (types[0], FFN, HIDDEN), (types[1], HIDDEN, FFN))]
    matrices = [Matrix(raw.ctypes.data, int(kind), raw.shape[1], cols, row_bytes(kind, cols), raw[0].nbytes)
                for raw, kind, cols in zip(stacks, (types[0], types[0], types[1]), (HIDDEN, HIDDEN, FFN))]
    return QuantizedExperts(kernels, {0: ExpertMatrices(*matrices, N_EXPERTS)}, threads, stacks)


def decode_steps(n_steps: int, k: int, seed: int):
    """One token's pairs through k distinct experts, n_steps times: (x [1, H], rows, experts, weights)."""
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(1, HIDDEN)).astype(np.float32), np.zeros(k, np.int64),
             rng.permutation(N_EXPERTS)[:k], rng.random(k).astype(np.float32)) for _ in range(n_steps)]


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q6_K), (T.Q8_0, T.Q4_0)], ids=lambda t: f"{t[0].name}-{t[1].name}")
@pytest.mark.parametrize("k", [1, 4, 8])
def test_decode_steps_do_not_depend_on_threads(kernels, types, k):
    """Down tasks of 8 to 32 rows (12 threads: finer tasks for fewer experts) start while other
    threads still run gate/up tasks; 20 steps each, the same bits as one thread."""
    steps = decode_steps(20, k, seed=k)
    one = layer(kernels, types, threads=1)
    want = [one.grouped_ffn(0, *step) for step in steps]
    for threads in (2, 5, 12):
        many = layer(kernels, types, threads)
        for step, expected in zip(steps, want):
            np.testing.assert_array_equal(many.grouped_ffn(0, *step), expected, err_msg=f"{threads} threads")


def test_batches_do_not_depend_on_threads(kernels):
    """Many tokens (the tiles dequantized first, the down tasks waiting on the last experts'
    gate/up tasks) at several thread counts, alternating: the same bits as one thread."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(64, HIDDEN)).astype(np.float32)
    rows = np.repeat(np.arange(64), 4)
    ids = np.concatenate([rng.permutation(N_EXPERTS)[:4] for _ in range(64)])
    weights = rng.random(len(rows)).astype(np.float32)
    want = layer(kernels, (T.Q4_K, T.Q6_K), threads=1).grouped_ffn(0, x, rows, ids, weights)
    for threads in (12, 3, 7, 2, 12):
        got = layer(kernels, (T.Q4_K, T.Q6_K), threads).grouped_ffn(0, x, rows, ids, weights)
        np.testing.assert_array_equal(got, want, err_msg=f"{threads} threads")


def test_workers_asleep_between_calls(kernels):
    """Calls further apart than the workers spin find them asleep; calls right after one another
    find them spinning. The results are the same either way."""
    steps = decode_steps(6, 4, seed=3)
    want = [layer(kernels, (T.Q4_K, T.Q6_K), threads=1).grouped_ffn(0, *step) for step in steps]
    many = layer(kernels, (T.Q4_K, T.Q6_K), threads=6)
    for gap_s in (0.0, 3 * POOL_SPIN_S, 0.0, 0.0, 3 * POOL_SPIN_S, 0.0):
        time.sleep(gap_s)
        for step, expected in zip(steps, want):
            np.testing.assert_array_equal(many.grouped_ffn(0, *step), expected)
