"""The grouped expert FFN of the CPU kernels against numpy_ops.grouped_ffn on the same
weights dequantized to float32: decode (one token, K experts), small batches with tokens that
have no pair here, prefill batches, gate and up fused in one tensor, and sizes that leave
partial tiles and tasks. Results do not depend on the thread count or on batching (fused
tiles or not); pairs padded as a router leaves them equal their ragged form; bad pairs are
refused."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.backends.cpu.library import ExpertMatrices, Matrix
from moerun.backends.numpy_backend import QuantizedExperts
from moerun.backends.numpy_ops import grouped_ffn
from tests.support.stored import T, random_stored, row_bytes, stored_values

BOUND = 1e-5          # |got - want| / |want| over the output: float32 throughout, other summation orders
N_EXPERTS = 12


class Stack:
    """E experts of one matrix [E, N, n] as stored, and their values."""

    def __init__(self, ggml_type: T, rows: int, cols: int, rng: np.random.Generator):
        self.raw = np.stack([random_stored(ggml_type, rows, cols, rng) for _ in range(N_EXPERTS)])
        self.values = np.stack([stored_values(r, ggml_type).reshape(rows, cols) for r in self.raw]).astype(np.float32)
        self.matrix = Matrix(self.raw.ctypes.data, int(ggml_type), rows, cols, row_bytes(ggml_type, cols),
                             rows * row_bytes(ggml_type, cols))


def experts_of(types: tuple[T, T], hidden: int, ffn: int, fused: bool, kernels, threads: int):
    """QuantizedExperts of one layer (layer 0) and the float32 (gate, up, down) of each expert."""
    rng = np.random.default_rng(hash((types, hidden, ffn, fused)) % 2**32)
    gate_up_type, down_type = types
    down = Stack(down_type, hidden, ffn, rng)
    if fused:
        both = Stack(gate_up_type, 2 * ffn, hidden, rng)
        m = both.matrix
        gate = Matrix(m.data, m.type, ffn, hidden, m.row_bytes, m.expert_bytes)
        up = Matrix(m.data + ffn * m.row_bytes, m.type, ffn, hidden, m.row_bytes, m.expert_bytes)
        values = [(v[:ffn], v[ffn:], d) for v, d in zip(both.values, down.values)]
        keep = [both.raw, down.raw]
    else:
        gate_stack, up_stack = Stack(gate_up_type, ffn, hidden, rng), Stack(gate_up_type, ffn, hidden, rng)
        gate, up = gate_stack.matrix, up_stack.matrix
        values = list(zip(gate_stack.values, up_stack.values, down.values))
        keep = [gate_stack.raw, up_stack.raw, down.raw]
    layers = {0: ExpertMatrices(gate, up, down.matrix, N_EXPERTS)}
    return QuantizedExperts(kernels, layers, threads, keep), values


def routed(n_tokens: int, k: int, rng: np.random.Generator, idle_share: float = 0.0):
    """Pairs (rows, experts, weights) of n_tokens tokens with k distinct experts each; a share
    of the tokens (never the first) has none."""
    busy = np.flatnonzero((rng.random(n_tokens) >= idle_share) | (np.arange(n_tokens) == 0))
    rows = np.repeat(busy, k)
    experts = np.concatenate([rng.permutation(N_EXPERTS)[:k] for _ in busy])
    return rows, experts, rng.random(len(rows)).astype(np.float32)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


CASES = [  # (gate/up type, down type), hidden, ffn, fused
    ((T.Q4_K, T.Q6_K), 256, 256, False),
    ((T.Q5_K, T.Q8_0), 512, 256, True),
    ((T.Q8_0, T.Q4_0), 160, 96, False),
    ((T.Q5_1, T.Q5_0), 96, 224, True),
    ((T.Q4_1, T.Q8_0), 64, 32, False),
    ((T.F16, T.BF16), 67, 45, False),
    ((T.BF16, T.F32), 33, 70, True),
]


@pytest.mark.parametrize("types, hidden, ffn, fused", CASES,
                         ids=[f"{a.name}-{b.name}-{h}x{f}{'-fused' if fused else ''}" for (a, b), h, f, fused in CASES])
@pytest.mark.parametrize("n_tokens, k, idle_share", [(1, 8, 0.0), (5, 3, 0.4), (300, 4, 0.1)],
                         ids=["decode", "few", "prefill"])
def test_grouped_ffn_matches_numpy(kernels, types, hidden, ffn, fused, n_tokens, k, idle_share):
    experts, values = experts_of(types, hidden, ffn, fused, kernels, threads=2)
    rng = np.random.default_rng(n_tokens)
    x = rng.normal(size=(n_tokens, hidden)).astype(np.float32)
    rows, ids, weights = routed(n_tokens, k, rng, idle_share)
    want = grouped_ffn(x, rows, ids, weights, lambda e: values[e])
    got = experts.grouped_ffn(0, x, rows, ids, weights)
    assert got.shape == x.shape and got.dtype == np.float32
    idle = np.setdiff1d(np.arange(n_tokens), rows)
    assert not got[idle].any(), "tokens without pairs here get zeros"
    assert relative_error(got, want) < BOUND


def test_threads_do_not_change_the_result(kernels):
    rng = np.random.default_rng(3)      # 100 tokens x 4 experts: several threads' work, a matrix unit's experts
    x = rng.normal(size=(100, 256)).astype(np.float32)
    rows, ids, weights = routed(100, 4, rng)
    results = []
    for threads in (1, 2, 3, 7):
        experts, _ = experts_of((T.Q4_K, T.Q6_K), 256, 256, False, kernels, threads)
        results.append(experts.grouped_ffn(0, x, rows, ids, weights))
    for result in results[1:]:
        np.testing.assert_array_equal(result, results[0])


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q6_K), (T.Q4_0, T.Q8_0), (T.Q5_K, T.BF16)],
                         ids=lambda t: f"{t[0].name}-{t[1].name}")
def test_one_token_at_a_time_equals_the_batch(kernels, types):
    """60 tokens over 12 experts (about 20 each) go through tiles dequantized first; one token at a
    time through the fused tiles: the same bits, on every instruction set; with a matrix unit
    (amx: the experts with 24 tokens or more, another order of summation), within float32
    rounding."""
    experts, _ = experts_of(types, 256, 256, False, kernels, threads=2)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(60, 256)).astype(np.float32)
    rows, ids, weights = routed(60, 4, rng)
    for isa in kernels.isas():
        kernels.use_isa(isa)
        batch = experts.grouped_ffn(0, x, rows, ids, weights)
        for t in range(0, 60, 7):
            pick = rows == t
            one = experts.grouped_ffn(0, x[t:t + 1], np.zeros(pick.sum(), np.int64), ids[pick], weights[pick])
            if kernels.unit_tokens:
                assert relative_error(batch[t], one[0]) < BOUND, f"{isa}, token {t}"
            else:
                np.testing.assert_array_equal(one[0], batch[t], err_msg=f"{isa}, token {t}")


def test_bad_pairs_are_refused(kernels):
    experts, _ = experts_of((T.Q8_0, T.Q8_0), 64, 32, False, kernels, threads=2)
    x = np.ones((2, 64), np.float32)
    one = np.ones(1, np.float32)
    with pytest.raises(ValueError, match="expert id out of range"):
        experts.grouped_ffn(0, x, np.array([0]), np.array([N_EXPERTS]), one)
    with pytest.raises(ValueError, match="token row out of range"):
        experts.grouped_ffn(0, x, np.array([2]), np.array([0]), one)
    with pytest.raises(ValueError, match="rows of 64 values"):
        experts.grouped_ffn(0, np.ones((2, 63), np.float32), np.array([0]), np.array([0]), one)


@pytest.mark.parametrize("with_map", [False, True])
def test_padded_pairs_equal_their_ragged_form(kernels, with_map):
    """ids [T, K] with -1 slots (and, with a map, local ids standing for the map's experts):
    bit for bit the ragged call over the same pairs, whatever the thread count."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(9, 256)).astype(np.float32)
    held = rng.permutation(N_EXPERTS)[:7]                        # local id i is expert held[i]
    ids = np.full((9, 5), -1, np.int64)
    for row in ids[1:]:                                          # token 0 has no expert here
        chosen = rng.permutation(len(held) if with_map else N_EXPERTS)[:rng.integers(1, 5)]
        row[rng.permutation(5)[:len(chosen)]] = chosen
    weights = rng.random((9, 5)).astype(np.float32)
    rows, slots = np.nonzero(ids >= 0)
    experts_of_pairs = held[ids[rows, slots]] if with_map else ids[rows, slots]
    for threads in (1, 3):
        experts, _ = experts_of((T.Q4_K, T.Q6_K), 256, 256, False, kernels, threads=threads)
        want = experts.grouped_ffn(0, x, rows, experts_of_pairs, weights[rows, slots])
        got = experts.padded_ffn(0, x, ids, weights, held if with_map else None)
        np.testing.assert_array_equal(got, want)
        assert np.all(got[0] == 0)


def test_bad_padded_ids_are_refused(kernels):
    experts, _ = experts_of((T.Q8_0, T.Q8_0), 64, 32, False, kernels, threads=2)
    x, weights = np.ones((2, 64), np.float32), np.ones((2, 3), np.float32)
    ids = np.array([[0, -1, -1], [-1, 2, -1]])
    with pytest.raises(ValueError, match="expert id out of range"):          # past the map
        experts.padded_ffn(0, x, ids, weights, np.array([4, 5]))
    with pytest.raises(ValueError, match="expert id out of range"):          # a map entry past the layer
        experts.padded_ffn(0, x, ids, weights, np.array([4, 5, N_EXPERTS]))
    with pytest.raises(ValueError, match=r"ids and weights \[T, K\]"):
        experts.padded_ffn(0, x, ids[:, :2], weights)
    np.testing.assert_array_equal(experts.padded_ffn(0, x, np.full((2, 3), -1), weights), np.zeros((2, 64)))
