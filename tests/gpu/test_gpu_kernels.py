"""Every stored type's products on the GPU against numpy on the dequantized weights,
on fresh random inputs: the decode GEMV (T <= 8: f32 for float weights; for quantized
ones, activations in two 8-bit planes per 32 and integer dot products), the decode
experts, the prefill products (f16 operands, f32 accumulation: dense, and the experts' tiles),
the embedding gather and the dequantization itself.

The 8-bit planes are checked twice: against numpy given the same converted activations
(only the order of the sums differs), and against the exact product (their rounding,
~2e-5 per element, only: Q8_BOUND)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from moerun.backends.devices import GpuError
from moerun.backends.gpu.library import INT_KINDS
from moerun.backends.gpu.weights import KERNEL_TYPES, DeviceMatrix
from moerun.backends.kv_types import KVTypes
from moerun.gguf.quants import dequantize
from moerun.writers.bench_model import BLOCK_FILLERS, random_blocks
from tests.support.gpu import gpu_device, small_spec

pytestmark = pytest.mark.gpu
T = GGMLQuantizationType
ROWS, COLS = 96, 512
Q8_BOUND = 1e-4
TF32_ATTENTION_BOUND = 3e-3
HIDDEN, FFN = 768, 256


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def q8_round_trip(x: np.ndarray) -> np.ndarray:
    """x [..., K] as the GPU converts it (per 32: d = max|x| / 127, plane a = rint(x / d),
    plane b = rint((x / d - a) · 254)), back as d · (a + b / 254)."""
    units = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(units).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    scaled = units * inv
    a = np.rint(scaled)
    b = np.rint((scaled - a) * np.float32(254))
    return ((a + b / 254) * (amax / np.float32(127))).reshape(x.shape).astype(np.float64)


def dequantized(raw: np.ndarray, ggml_type: T) -> np.ndarray:
    """The values of raw bytes stored as ggml_type, in f64."""
    element_views = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}
    view = raw.view(element_views[ggml_type]) if ggml_type in element_views else raw
    return dequantize(view, ggml_type).astype(np.float64)


def random_matrix(ggml_type: T, rng: np.random.Generator, rows: int = ROWS, cols: int = COLS) -> np.ndarray:
    """Raw bytes [rows, row bytes] of a random matrix stored as ggml_type."""
    if ggml_type in BLOCK_FILLERS:
        block_size, _ = GGML_QUANT_SIZES[ggml_type]
        return random_blocks(ggml_type, rows * cols // block_size, rng).reshape(rows, -1)
    values = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
    if ggml_type == T.F32:
        return values.view(np.uint8)
    return gguf_quants.quantize(values, ggml_type).view(np.uint8).reshape(rows, -1)


@pytest.fixture(scope="module")
def backend():
    from moerun.backends import open_backend
    return open_backend(gpu_device(), small_spec())


@pytest.fixture(params=list(KERNEL_TYPES), ids=[t.name for t in KERNEL_TYPES])
def stored(request, backend):
    ggml_type = request.param
    raw = random_matrix(ggml_type, np.random.default_rng())
    reference = dequantized(raw, ggml_type).reshape(ROWS, COLS)
    matrix = DeviceMatrix(backend.device.cupy.asarray(raw.reshape(-1)), KERNEL_TYPES[ggml_type], ROWS, COLS)
    return matrix, reference


@pytest.mark.parametrize("n_tokens", [1, 3, 8])
def test_decode_gemv_matches_dequantized_product(backend, stored, n_tokens):
    matrix, reference = stored
    x = np.random.default_rng().normal(size=(n_tokens, COLS)).astype(np.float32)
    residual = np.random.default_rng().normal(size=(n_tokens, ROWS)).astype(np.float32)
    got = backend.linear(backend.device.cupy.asarray(x), matrix, residual=backend.device.cupy.asarray(residual)).get()
    exact = x @ reference.T + residual
    if matrix.kind in INT_KINDS:
        assert relative_error(got, q8_round_trip(x) @ reference.T + residual) < 1e-5
        assert 0 < relative_error(got, exact) < Q8_BOUND
    else:
        assert relative_error(got, exact) < 1e-5


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_decode_gemv_of_many_float_rows(backend, ggml_type):
    """Float matrices of more than FEW_ROWS rows take the row-group kernel (fewer rows: a block
    per row, as in the test above)."""
    from moerun.backends.gpu.backend import FEW_ROWS
    rows = FEW_ROWS + 40
    raw = random_matrix(ggml_type, np.random.default_rng(), rows=rows)
    reference = dequantized(raw, ggml_type).reshape(rows, COLS)
    matrix = DeviceMatrix(backend.device.cupy.asarray(raw.reshape(-1)), KERNEL_TYPES[ggml_type], rows, COLS)
    x = np.random.default_rng().normal(size=(3, COLS)).astype(np.float32)
    got = backend.linear(backend.device.cupy.asarray(x), matrix).get()
    assert relative_error(got, x @ reference.T) < 1e-5


EXPERT_TYPES = [(T.Q4_K, T.Q6_K), (T.Q8_0, T.Q8_0), (T.Q5_K, T.Q4_0), (T.Q5_0, T.Q4_1), (T.F16, T.F16),
                (T.BF16, T.F32)]


@pytest.mark.parametrize("n_tokens", [1, 3, 8, 40, 100, 300])
@pytest.mark.parametrize("types", EXPERT_TYPES, ids=lambda types: "-".join(t.name for t in types))
def test_experts_match_numpy(types, n_tokens):
    """gate/up + SwiGLU + down with the routing weights, some pairs not resident (id -1):
    decode (T <= 8) and prefill tiles (T > 8, f16 operands; 4 of 6 experts a token: tiles of 32
    rows at 40 tokens, 64 at 100, 128 at 300). HIDDEN and FFN: 24 and 8 units of 32 (K-quant
    rows hold whole super-blocks of 256)."""
    check_experts(types, n_tokens, HIDDEN, FFN)


@pytest.mark.parametrize("n_tokens", [5, 70, 100, 300])
def test_experts_of_odd_sizes_match_numpy(n_tokens):
    """Widths that leave the prefill tiles' last stage and last column block part empty, for
    every tile shape (70, 100 and 300 tokens: tiles of 32, 64 and 128 rows)."""
    check_experts((T.Q8_0, T.Q4_0), n_tokens, hidden=96, ffn=160)


DECODE_ROW_SHAPES = [   # (hidden, ffn, types, gate/up (rows, threads) a group, (down's threads a row, rows a group))
    (3072, 8192, (T.Q4_K, T.Q6_K), (2, 8), (32, 4)),      # Mixtral-like: wide hidden, long down rows
    (3072, 8192, (T.Q8_0, T.Q5_0), (2, 8), (32, 4)),
    (768, 2048, (T.Q5_K, T.Q4_1), (1, 16), (16, 2)),
    (4096, 1536, (T.Q4_K, T.Q6_K), (1, 16), (16, 2)),      # Qwen3-235B-like: wide hidden, short experts
    (96, 96, (T.Q8_0, T.Q4_0), (1, 16), (1, 1)),           # three units a down row: one thread, one row
]


@pytest.mark.parametrize("n_tokens", [1, 4])
@pytest.mark.parametrize("hidden, ffn, types, gate_up_rows, down_rows", DECODE_ROW_SHAPES,
                         ids=lambda value: "-".join(t.name for t in value) if isinstance(value, tuple) and
                         isinstance(value[0], T) else None)
def test_expert_decode_row_shapes_match_numpy(hidden, ffn, types, gate_up_rows, down_rows, n_tokens):
    """Each shape of the decode expert kernels (rows per group of gate/up, threads and rows per
    group of down, experts.py) against numpy."""
    from moerun.backends.gpu.experts import decode_down_rows, decode_gate_up_shape
    assert decode_gate_up_shape(hidden, ffn) == gate_up_rows and decode_down_rows(ffn // 32, 4) == down_rows
    check_experts(types, n_tokens, hidden, ffn)


def check_experts(types: tuple[T, T], n_tokens: int, hidden: int, ffn: int) -> None:
    from moerun.backends import open_backend
    from moerun.backends.gpu.experts import GpuExperts, LayerExperts
    spec = small_spec(hidden=hidden, experts=6, top_k=4, expert_ff=ffn)
    backend = open_backend(gpu_device(), spec)
    rng = np.random.default_rng()
    gate_up_type, down_type = types
    (gate, gate_ref), (up, up_ref) = (expert_stack(backend, gate_up_type, 6, ffn, hidden, rng) for _ in range(2))
    down, down_ref = expert_stack(backend, down_type, 6, hidden, ffn, rng)
    experts = GpuExperts(backend, spec, {0: LayerExperts(gate, up, 0, down)})
    x = rng.normal(size=(n_tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.permutation(6)[:4] for _ in range(n_tokens)]).astype(np.int32)
    unresident = rng.random(ids.shape) < 0.25
    unresident[:, 0] = False                            # every token keeps one expert: a non-zero result
    ids[unresident] = -1
    weights = rng.random(ids.shape).astype(np.float32)
    on_device = [backend.device.cupy.asarray(a) for a in (x, ids, weights)]
    got = experts.compute(0, *on_device).get()
    residual = rng.normal(size=(n_tokens, hidden)).astype(np.float32)
    with_residual = experts.compute(0, *on_device, residual=backend.device.cupy.asarray(residual)).get()
    np.testing.assert_array_equal(with_residual, residual + got)      # added by the last kernel: the same bits

    def expected(quantized: bool) -> np.ndarray:
        xs = q8_round_trip(x) if quantized else x.astype(np.float64)
        out = np.zeros((n_tokens, hidden))
        for t, k in zip(*np.nonzero(ids >= 0)):
            e = ids[t, k]
            g, u = gate_ref[e] @ xs[t], up_ref[e] @ xs[t]
            act = g / (1 + np.exp(-g)) * u
            out[t] += weights[t, k] * (down_ref[e] @ (q8_round_trip(act) if quantized else act))
        return out

    if n_tokens > 8:
        assert 0 < relative_error(got, expected(quantized=False)) < 2e-3      # f16 operands: rounded, but only that
    elif gate.kind in INT_KINDS:
        # the same 8-bit planes: only a plane digit that rounds the other way where the GPU's fused
        # multiply-add and numpy's product differ in the last bit (1.41e-5 seen once, Q5_0-Q4_1, one token)
        assert relative_error(got, expected(quantized=True)) < 5e-5
        assert 0 < relative_error(got, expected(quantized=False)) < Q8_BOUND
    else:
        assert relative_error(got, expected(quantized=False)) < 1e-5


SWIGLU_SHAPES = [   # (hidden, ffn, gate/up type, down type): shared experts wider than the routed ones' 128
    (3584, 2560, T.Q4_K, T.Q6_K),    # Qwen2-57B's shared expert at an eighth of its 20,480 rows
    (768, 512, T.Q8_0, T.Q5_0),
    (256, 1024, T.Q5_K, T.F16),      # a float down: the products at one token too
]


@pytest.mark.parametrize("n_tokens", [1, 3])
@pytest.mark.parametrize("hidden, ffn, gate_up_type, down_type", SWIGLU_SHAPES,
                         ids=lambda value: value.name if isinstance(value, T) else None)
def test_swiglu_ffn_matches_numpy(hidden, ffn, gate_up_type, down_type, n_tokens):
    """A SwiGLU FFN (shared expert, dense layer) whose width is not the routed experts': one token
    of quantized matrices through the experts' kernels as a stack of one, else the products; the
    residual added by the last kernel."""
    from moerun.backends import open_backend
    spec = small_spec(hidden=hidden, expert_ff=128)
    backend = open_backend(gpu_device(), spec)
    rng = np.random.default_rng()
    (gate, gate_ref), (up, up_ref) = (expert_stack(backend, gate_up_type, 1, ffn, hidden, rng) for _ in range(2))
    down, down_ref = expert_stack(backend, down_type, 1, hidden, ffn, rng)
    x = rng.normal(size=(n_tokens, hidden)).astype(np.float32)
    residual = rng.normal(size=(n_tokens, hidden)).astype(np.float32)
    cupy = backend.device.cupy
    got = backend.swiglu_ffn(cupy.asarray(x), (gate, up, down)).get()
    with_residual = backend.swiglu_ffn(cupy.asarray(x), (gate, up, down), residual=cupy.asarray(residual)).get()
    np.testing.assert_allclose(with_residual, residual + got, rtol=1e-6, atol=1e-6 * np.abs(got).max())
    g, u = x @ gate_ref[0].T, x @ up_ref[0].T
    exact = (g / (1 + np.exp(-g)) * u) @ down_ref[0].T
    assert 0 < relative_error(got, exact) < Q8_BOUND                 # gate/up's activations in 8-bit planes


@pytest.mark.parametrize("ggml_type", [T.Q6_K, T.Q4_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("rows, cols", [(1001, 2048), (333, 3584), (130, 4096)])
def test_one_token_gemv_at_model_widths(backend, ggml_type, rows, cols):
    """The one-token kernel (gemv_q8_one: four units a lane, blocks of 128 threads) at the LM
    head's and shared experts' widths (16 and 32 threads a row, rows not 16-byte aligned at 3584),
    an odd last row, and the few-token kernel's result for the same token."""
    rng = np.random.default_rng()
    raw = random_matrix(ggml_type, rng, rows, cols)
    reference = dequantized(raw, ggml_type).reshape(rows, cols)
    matrix = DeviceMatrix(backend.device.cupy.asarray(raw.reshape(-1)), KERNEL_TYPES[ggml_type], rows, cols)
    x = rng.normal(size=(2, cols)).astype(np.float32)
    one = backend.linear(backend.device.cupy.asarray(x[:1]), matrix).get()
    few = backend.linear(backend.device.cupy.asarray(x), matrix).get()
    assert relative_error(one, q8_round_trip(x[:1]) @ reference.T) < 1e-5
    np.testing.assert_allclose(one[0], few[0], rtol=1e-5, atol=1e-5 * np.abs(few[0]).max())


def expert_stack(backend, ggml_type: T, n_experts: int, rows: int, cols: int, rng) -> tuple[DeviceMatrix, np.ndarray]:
    """A random stack [E, rows, cols] on the device and its dequantized values."""
    raw = np.concatenate([random_matrix(ggml_type, rng, rows, cols) for _ in range(n_experts)])
    matrix = DeviceMatrix(backend.device.cupy.asarray(raw.reshape(-1)), KERNEL_TYPES[ggml_type], rows, cols, n_experts)
    return matrix, dequantized(raw, ggml_type).reshape(n_experts, rows, cols)


def test_prefill_product_matches_dequantized_product(backend, stored):
    matrix, reference = stored
    x = np.random.default_rng().normal(size=(40, COLS)).astype(np.float32)
    got = backend.linear(backend.device.cupy.asarray(x), matrix).get()
    error = relative_error(got, x @ reference.T)
    assert 0 < error < 2e-3      # f16 operands: rounded, but only that


def test_dequantize_f16_and_gather_rows(backend, stored):
    matrix, reference = stored
    assert np.allclose(backend.dequantize_f16(matrix).get(), reference, rtol=1e-3, atol=1e-7)
    ids = np.random.default_rng().integers(0, ROWS, 5)
    got = backend.embed(matrix, backend.upload_ids(ids)).get()
    assert np.allclose(got, reference[ids], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows", [32, 64, 128])
@pytest.mark.parametrize("skew", [0.05, 1.0, 50.0])
def test_expert_tile_layout(backend, skew, rows):
    """Every routed pair gets its own row among its expert's tiles, holding its token."""
    from moerun.backends.gpu.experts import TileLayout
    rng = np.random.default_rng()
    n_tokens, top_k, n_experts = 300, 4, 16
    p = rng.dirichlet(np.full(n_experts, skew))
    ids = np.stack([rng.choice(n_experts, top_k, replace=False, p=p) for _ in range(n_tokens)]).astype(np.int32)
    layout = TileLayout(backend, backend.device.cupy.asarray(ids), n_experts, rows)
    pair_rows, token_rows = layout.pair_rows.get(), layout.token_rows.get()
    tile_expert, tile_row = layout.tile_expert.get(), layout.tile_row.get()
    assert np.array_equal(layout.counts.get(), np.bincount(ids.reshape(-1), minlength=n_experts))
    assert len(set(pair_rows.tolist())) == ids.size
    assert np.array_equal(token_rows[pair_rows], np.arange(ids.size) // top_k)
    assert (token_rows >= 0).sum() == ids.size
    owner = np.full(layout.max_rows, -1)
    for expert, first in zip(tile_expert, tile_row):
        if expert >= 0:
            owner[first:first + rows] = expert
    assert np.array_equal(owner[pair_rows], ids.reshape(-1))


@pytest.mark.parametrize("n_tokens", [1, 5, 8, 20])
@pytest.mark.parametrize("n_experts, top_k, renormalize", [(128, 8, True), (60, 4, False), (512, 10, True)])
@pytest.mark.parametrize("ties", [False, True])
def test_routing_matches_numpy(n_tokens, n_experts, top_k, renormalize, ties):
    """x through the norm and an f32 router (for up to 8 tokens one launch, route_normed; the
    norm, the product and route_top_k for more), then top-K; exact ties go to the lower id. The
    normed h comes back too, and in the 8-bit planes quantize_q8 makes of it."""
    import dataclasses

    from moerun.backends import open_backend
    from moerun.backends.numpy_backend import NumpyBackend
    spec = small_spec(hidden=HIDDEN, experts=n_experts, top_k=top_k)
    spec = dataclasses.replace(spec, rule=dataclasses.replace(spec.rule, renormalize_topk=renormalize),
                               rms_eps=0.0 if ties else spec.rms_eps)
    backend = open_backend(gpu_device(), spec)
    rng = np.random.default_rng()
    router = rng.normal(0, 0.05, (n_experts, HIDDEN)).astype(np.float32)
    x = rng.normal(size=(n_tokens, HIDDEN)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
    if ties:        # small multiples of 1/4 whose sums are exact in any order; repeated rows tie exactly
        router = (rng.integers(-2, 3, (n_experts, HIDDEN)) / 8).astype(np.float32)
        router[1::3] = router[0::3][: len(router[1::3])]
        x = rng.choice(np.float32([-1, 1]), (n_tokens, HIDDEN))     # with no eps, h = x exactly
        norm = np.ones(HIDDEN, np.float32)
    matrix = DeviceMatrix(backend.device.cupy.asarray(router.view(np.uint8).reshape(-1)), "f32", n_experts, HIDDEN)
    want_h, want_ids, want_weights = NumpyBackend(spec).route(x, norm, router)
    h, ids, weights = backend.route(backend.device.cupy.asarray(x), backend.device.cupy.asarray(norm), matrix)
    np.testing.assert_allclose(h.get(), want_h, rtol=2e-6, atol=1e-6)
    assert np.array_equal(ids.get(), want_ids)
    np.testing.assert_allclose(weights.get(), want_weights, rtol=1e-5, atol=1e-7)
    if n_tokens <= 8:
        planes, scales = backend.q8_of(h)
        want_planes, want_scales = backend.quantize_q8(h)
        assert backend.device.cupy.array_equal(planes, want_planes)
        assert backend.device.cupy.allclose(scales, want_scales, rtol=1e-6, atol=0)


@pytest.mark.parametrize("n_tokens", [1, 3, 8])
@pytest.mark.parametrize("normed", [False, True], ids=["planes", "norm-folded"])
def test_three_products_in_one_launch(backend, n_tokens, normed):
    """q, k, v of different types and heights (blocks straddle two of them), with biases; with
    a norm, of rms_norm(x) (each block converting the normed rows itself)."""
    from moerun.backends.numpy_ops import rms_norm
    rng = np.random.default_rng()
    shapes = [(T.Q4_K, 95), (T.Q8_0, 41), (T.Q6_K, 20)]
    matrices, references = [], []
    for ggml_type, rows in shapes:
        raw = random_matrix(ggml_type, rng, rows, COLS)
        references.append(dequantize(raw, ggml_type).reshape(rows, COLS).astype(np.float64))
        matrices.append(DeviceMatrix(backend.device.cupy.asarray(raw.reshape(-1)), KERNEL_TYPES[ggml_type], rows, COLS))
    biases = [rng.normal(size=rows).astype(np.float32) for _, rows in shapes]
    x = rng.normal(size=(n_tokens, COLS)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, COLS).astype(np.float32) if normed else None
    cupy = backend.device.cupy
    outs = backend.linears(cupy.asarray(x), tuple(matrices), tuple(cupy.asarray(b) for b in biases),
                           None if norm is None else cupy.asarray(norm))
    h = x if norm is None else rms_norm(x, norm, backend.spec.rms_eps)
    for got, reference, bias in zip(outs, references, biases):
        assert relative_error(got.get(), q8_round_trip(h) @ reference.T + bias) < 1e-5


# Decode attention: (cache capacity, first token's position, tokens, splits per head). None keeps
# the backend's own count (at most one split per 64 positions of the span; counted here as on an
# H100); a forced count gives shares past the 256 rows a split scores at a time (walked with the
# running softmax) and empty splits that a large GPU's count would not. The comments give each
# token's splits (rows [a, b)).
ATTENTION_CASES = {                                     # small_spec: 4 heads over 2 KV heads of 64 dims
    "position-0": (4096, 0, 1, None),                   # 64 splits: [0, 1), 63 empty
    "small-position-many-chunks": (4096, 5, 1, None),   # 64 splits: [0, 6), 63 empty
    "uneven": (256, 133, 1, None),                      # 4 splits of 64: the third [128, 134), one empty
    "last-row": (256, 255, 1, None),                    # 4 full splits of 64
    "uneven-3-tokens": (256, 133, 3, None),             # 4 splits; each token's ends at its position
    "8-tokens": (512, 500, 8, None),                    # 8 splits; each token's last ends at its position
    "one-split-4-runs": (1024, 1000, 1, 1),             # [0, 1001), many runs of each group
    "3-splits": (1024, 1000, 1, 3),                     # [0, 352), [352, 704), [704, 1001)
    "7-splits-5-empty": (1024, 40, 1, 7),               # [0, 32), [32, 41), 5 empty
    "last-row-5-splits": (1024, 1023, 1, 5),            # 4 of 224, then [896, 1024)
    "3-tokens-2-splits": (1024, 600, 3, 2),             # [0, 320), [320, position + 1)
}

@pytest.fixture(scope="module", params=["f16", "f32"])
def kv_backend(request):
    """A backend with its KV cache in each element type."""
    from moerun.backends import open_backend
    return open_backend(gpu_device(), small_spec(), kv_types=KVTypes(request.param, request.param))


@pytest.fixture(params=["per-head", "grouped"])
def decode_kernel(request, monkeypatch):
    """Decode attention through a block per query head, or through the grouped kernel (which
    only steps past GROUPED_ATTENTION_SPAN positions take otherwise)."""
    from moerun.backends.gpu import backend as gpu_backend
    monkeypatch.setattr(gpu_backend, "GROUPED_ATTENTION_SPAN", 1 << 30 if request.param == "per-head" else 0)
    return request.param


@pytest.mark.parametrize("capacity, start, n_tokens, splits", ATTENTION_CASES.values(), ids=list(ATTENTION_CASES))
def test_decode_attention_matches_numpy(kv_backend, decode_kernel, monkeypatch, capacity, start, n_tokens, splits):
    """Split-K attention of tokens at positions start.. over the cache (f16 or f32), each split an
    equal share of its token's own positions, against numpy over the values the cache holds; the
    8-bit planes the combine writes are quantize_q8's of its output."""
    from moerun.backends.gpu import backend as gpu_backend
    if splits is not None:
        monkeypatch.setattr(gpu_backend, "attention_splits", lambda span, heads, wave: splits)
    got, want = attention_and_numpy(kv_backend, capacity, start, n_tokens)
    assert relative_error(got.get(), want) < 1e-5
    planes, scales = kv_backend.q8_of(got)
    want_planes, want_scales = kv_backend.quantize_q8(got)
    assert kv_backend.device.cupy.array_equal(planes, want_planes)
    assert kv_backend.device.cupy.allclose(scales, want_scales, rtol=1e-6, atol=0)


HEAD_LAYOUTS = {                 # (NH, NKV, D): the architectures' decode attention shapes
    "gqa-32/4-d128": (32, 4, 128),   # Qwen3-30B-A3B: 8 heads a tile
    "gqa-64/4-d128": (64, 4, 128),   # Qwen3-235B-A22B: two tiles of 8 a group
    "gqa-16/2-d256": (16, 2, 256),   # Qwen3.6-35B-A3B's attention layers: tiles of 4 at 8 dims a lane
    "gqa-32/8-d128": (32, 8, 128),   # Mixtral: tiles of 4
    "mha-16/16-d128": (16, 16, 128),  # OLMoE, Qwen1.5-MoE: one head a block
    "gqa-8/1-d64": (8, 1, 64),       # 2 dims a lane
}


@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
@pytest.mark.parametrize("position", [1, 4096, 32768, 131071])
@pytest.mark.parametrize("layout", HEAD_LAYOUTS.values(), ids=list(HEAD_LAYOUTS))
def test_decode_attention_at_depth_matches_numpy(decode_kernel, layout, position, kv_dtype):
    """One token at `position` over a cache of that many rows and a few more (NaN, never read),
    for every head layout the architectures use, against numpy in f64 over the values the cache
    holds; queries scaled so the softmax has a few hundred rows that count, not 128k alike."""
    from moerun.backends import open_backend
    n_heads, n_kv_heads, head_dim = layout
    spec = replace(small_spec(), n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim_k=head_dim, head_dim_v=head_dim)
    backend = open_backend(gpu_device(), spec, kv_types=KVTypes(kv_dtype, kv_dtype))
    got, want = attention_and_numpy(backend, position + 8, position, 1, query_scale=2.0)
    assert relative_error(got.get(), want) < 2e-5


def attention_and_numpy(backend, capacity: int, start: int, n_tokens: int, query_scale: float = 1.0) -> tuple:
    """The backend's attention of random tokens at positions start.. over a cache of random rows
    (values its type holds exactly; NaN past the tokens, which must not be read), and numpy's."""
    from moerun.backends.numpy_ops import causal_attention
    spec, cupy = backend.spec, backend.device.cupy
    rng = np.random.default_rng()
    cache = backend.new_cache(capacity)
    stored = cache.k[0].dtype
    k = rng.normal(size=(start + n_tokens, spec.n_kv_heads, spec.head_dim_k)).astype(stored).astype(np.float32)
    v = rng.normal(size=(start + n_tokens, spec.n_kv_heads, spec.head_dim_v)).astype(stored).astype(np.float32)
    cache.k[0][: len(k)] = cupy.asarray(k)
    cache.v[0][: len(v)] = cupy.asarray(v)
    cache.k[0][len(k):] = cupy.nan
    cache.v[0][len(v):] = cupy.nan
    cache.length = start
    q = rng.normal(scale=query_scale, size=(n_tokens, spec.n_heads * spec.head_dim_k)).astype(np.float32)
    positions = cupy.arange(start, start + n_tokens, dtype=cupy.int32)
    want = causal_attention(*(a.astype(np.float64) for a in (q.reshape(n_tokens, spec.n_heads, -1), k, v)), start)
    return backend.attention(cupy.asarray(q), cache, 0, positions), want


def test_rope_append_writes_the_cache_in_its_type(kv_backend):
    """Rope and the append of 24 tokens at positions 40..63: the f16 cache holds exactly the f32
    cache's values rounded to nearest (numpy's rounding), and the rotated queries do not depend on
    the cache's type."""
    from moerun.backends import open_backend
    spec, cupy = kv_backend.spec, kv_backend.device.cupy
    exact = open_backend(gpu_device(), spec, kv_types=KVTypes("f32", "f32"))
    rng = np.random.default_rng()
    n_tokens, start = 24, 40
    q, k = (rng.normal(size=(n_tokens, heads * spec.head_dim_k)).astype(np.float32)
            for heads in (spec.n_heads, spec.n_kv_heads))
    v = rng.normal(size=(n_tokens, spec.n_kv_heads * spec.head_dim_v)).astype(np.float32)
    norm = rng.normal(size=spec.head_dim_k).astype(np.float32)
    caches, rotated = [], []
    for backend in (kv_backend, exact):
        cache = backend.new_cache(128)
        positions = cupy.arange(start, start + n_tokens, dtype=cupy.int32)
        inputs = (cupy.asarray(a) for a in (q, k, v, norm, norm))
        rotated.append(backend.rope_append(*inputs, cache, 0, positions).get())
        caches.append((cache.k[0][start:start + n_tokens].get(), cache.v[0][start:start + n_tokens].get()))
    assert np.array_equal(rotated[0], rotated[1])
    for stored, full in zip(*caches):
        assert stored.dtype == kv_backend.new_cache(128).k[0].dtype
        assert np.array_equal(stored, full.astype(stored.dtype))


@pytest.mark.parametrize("start", [0, 40])
def test_prefill_attention_matches_numpy(kv_backend, start):
    """A chunk of 24 tokens at positions start.. over the cache (f16 or f32) through the head
    expansion and the batched TF32 products, against numpy over the values the cache holds: TF32
    keeps 10 bits of each operand's mantissa (2^-11 relative)."""
    got, want = attention_and_numpy(kv_backend, 128, start, 24)
    assert relative_error(got.get(), want) < TF32_ATTENTION_BOUND


@pytest.mark.parametrize("start, n_tokens", [(0, 24), (40, 24), (100, 24), (10, 40)])
def test_prefill_attention_by_blocks_matches_numpy(kv_backend, monkeypatch, start, n_tokens):
    """The same through blocks of 32 cache positions, so that the running softmax merges several:
    a last block narrower than the rest, and (10, 40) rows that see nothing of the second block
    (positions 10..31 against [32, 50))."""
    from moerun.backends.gpu import backend as gpu_backend
    monkeypatch.setattr(gpu_backend, "PREFILL_KEY_BLOCK", 32)
    got, want = attention_and_numpy(kv_backend, 128, start, n_tokens)
    assert relative_error(got.get(), want) < TF32_ATTENTION_BOUND


def test_hopper_launches_kernels_as_dependent_launches(backend):
    """On compute capability 9.0 and later the suite's kernels go through cuLaunchKernelEx with
    programmatic serialization (so every product test here checks that path); a launch with
    a bad argument is refused with the driver's reason."""
    cupy = backend.device.cupy
    if cupy.cuda.runtime.is_hip or int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launches need CUDA compute capability 9.0")
    kernels = backend.device.kernels
    assert kernels._dependent is not None
    x = cupy.arange(1000, dtype=cupy.float32)
    out = cupy.empty_like(x)
    kernels.elementwise("add_gated", x.size, (x, x, np.uint64(0), np.int32(10), np.int64(x.size), out))
    assert cupy.array_equal(out, 2 * x)
    with pytest.raises(GpuError, match=r"the GPU failed in kernel add_gated \(grid \(1,\), block \(4096,\)\): "
                                       r"CUDA_ERROR_"):
        kernels.launch("add_gated", (1,), (4096,), (x, x, np.uint64(0), np.int32(10), np.int64(x.size), out))


def test_a_plain_launch_that_fails_names_its_kernel(backend, monkeypatch):
    """Where launches are CuPy's own (HIP, GPUs before 9.0), a refused launch is a GpuError too."""
    cupy = backend.device.cupy
    monkeypatch.setattr(backend.device.kernels, "_dependent", None)
    x = cupy.arange(1000, dtype=cupy.float32)
    with pytest.raises(GpuError, match=r"the GPU failed in kernel add_gated .*: .*(INVALID|invalid)"):
        backend.device.launch("add_gated", (1,), (4096,), (x, x, np.uint64(0), np.int32(10), np.int64(x.size), x))
