"""Every architecture's real shape on the GPU against the CPU backend: the bench model's presets
(Mixtral's few wide experts, OLMoE's and Qwen3's many narrow ones, the shared experts of
qwen2moe, hidden sizes up to 4096, the hybrid's DeltaNet), one layer at the real width and two
at reduced width, in each quant mix; prefill in chunks of 1, 7, 64, 512 and 2048 tokens, each
followed by a short chunk against the cache it filled, then decode steps.

The CPU takes the experts the GPU chose. With random weights the nearest routing margins over
2048 tokens are 1e-5..4e-4 while the GPU's f16 operands move them by 1e-4..9e-4, so a run flips
1 to 13 near-ties, and each flipped pair costs 1e-3..3e-2 of the logits
(scripts/emulate_gpu_rounding.py, which reproduces the GPU's errors from its roundings alone):
that measures the routing's conditioning, not the kernels. The routing itself (norm, product,
top-K) is checked by test_gpu_kernels.py (route.cu against numpy) and test_gpu_model.py.

Bounds, from the roundings' own errors with the routing pinned (emulated: 3.4e-4..8.1e-4 for
the products at reduced width, 1.0e-3 at Mixtral's real width, 1.67e-3 at Qwen3-235B's hidden size
of 4096 and 1.05e-3 in the chunk after it, where the GPU gave 1.68e-3 and 1.03e-3; 2.1e-3 for the
hybrid): chunks of more than 8 tokens go through the prefill products (f16 operands, TF32
attention), PRODUCT_BOUND; chunks of at most 8 and decode steps go through the GEMVs (8-bit
activation planes), GEMV_BOUND, but after a long chunk they read the K/V (and a hybrid's state)
that chunk wrote and carry its error, AFTER_PRODUCTS_BOUND. The GPU's KV cache is f32, so only the
kernels' own rounding counts."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.backends.gpu.constants import MAX_GEMV_TOKENS
from moerun.backends.numpy_ops import softmax
from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig
from moerun.writers.bench_model import MIXES, PRESETS, REAL_SHAPES, reduced, with_layers, write_bench_model
from tests.support.gpu import INT_GEMV_BOUND, gpu_device

pytestmark = pytest.mark.gpu
PRODUCT_BOUND = {"plain": 2.5e-3, "hybrid": 3e-3}
GEMV_BOUND = {"plain": INT_GEMV_BOUND, "hybrid": 6e-4}
AFTER_PRODUCTS_BOUND = {"plain": 1.5e-3, "hybrid": 1.5e-3}
CHUNKS = (1, 7, 64, 512, 2048)
SHORT_CHUNK = 5                 # after each chunk: a few tokens against the cache it filled
DECODE_STEPS = 3
FILES = [(preset, "q4_k_m") for preset in REAL_SHAPES] + [("mixtral-8x7b", "q8_0"), ("qwen3-30b-a3b", "q8_0"),
                                                           ("olmoe-1b-7b", "q5_k_m"), ("qwen2-57b-a14b", "q5_k_m")]


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.fixture(scope="module", params=[(p, m, width) for p, m in FILES for width in ("real", "reduced")],
                ids=lambda param: "-".join(param))
def shape_file(request, tmp_path_factory):
    preset, mix, width = request.param
    shape = PRESETS[preset]
    layers = shape.hybrid.full_attention_interval if shape.hybrid else 1     # a hybrid: one attention layer
    shape = with_layers(shape, layers) if width == "real" else reduced(shape, n_layers=max(2, layers))
    return shape, write_bench_model(tmp_path_factory.mktemp(preset) / f"{mix}.gguf", shape, MIXES[mix], seed=5)


@pytest.fixture(scope="module")
def runtimes(shape_file):
    """The file on the CPU and on the GPU (eager: every step routes in Python), with room for the longest test."""
    shape, path = shape_file
    ctx = max(CHUNKS) + SHORT_CHUNK + DECODE_STEPS
    with Runtime(path, ctx=ctx, rig=RigConfig(device="cpu")) as cpu, \
            Runtime(path, ctx=ctx, rig=RigConfig(device=gpu_device(), kv_dtype="f32", graphs=False)) as gpu:
        yield shape, cpu, gpu


def record_routing(runtime: Runtime, monkeypatch) -> list[np.ndarray]:
    """The expert ids [T, K] of every MoE layer call of `runtime`, in call order, as they come."""
    tape, route = [], runtime.backend.route

    def recording(x, norm, router):
        h, ids, weights = route(x, norm, router)
        tape.append(np.asarray(runtime.backend.to_host(ids)))
        return h, ids, weights
    monkeypatch.setattr(runtime.backend, "route", recording)
    return tape


def replay_routing(runtime: Runtime, tape: list[np.ndarray], monkeypatch) -> None:
    """`runtime` routes to the taped experts, each weighted by its own router's softmax as the
    architecture's rule says (renormalised over the K or not)."""
    backend, renormalize, calls = runtime.backend, runtime.spec.rule.renormalize_topk, iter(tape)
    route = backend.route

    def replaying(x, norm, router):
        h, _, _ = route(x, norm, router)
        ids = next(calls)
        probs = softmax(np.asarray(backend.linear(h, router), np.float32), axis=-1)        # [T, E]
        weights = np.take_along_axis(probs, ids.astype(np.int64), axis=-1)
        if renormalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return h, ids.astype(np.int64), weights.astype(np.float32)
    monkeypatch.setattr(backend, "route", replaying)


def step_logits(runtime: Runtime, ids: list[int], chunk: int, decode: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Logits [T, V] of ids prefilled in chunks of `chunk` on one cache, then [S, V] of one-token steps."""
    cache = runtime.backend.new_cache(runtime.ctx)
    rows = [runtime.model.forward(np.asarray(ids[start:start + chunk]), cache, all_logits=True)
            for start in range(0, len(ids), chunk)]
    steps = [runtime.model.forward(np.array([token]), cache, all_logits=False) for token in decode]
    return np.concatenate(rows), np.concatenate(steps)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_prefill_chunks_and_decode_match_the_cpu(runtimes, chunk, monkeypatch):
    shape, cpu, gpu = runtimes
    rng = np.random.default_rng(chunk)
    ids = rng.integers(0, shape.vocab, chunk + SHORT_CHUNK).tolist()
    decode = rng.integers(0, shape.vocab, DECODE_STEPS).tolist()
    tape = record_routing(gpu, monkeypatch)
    got_rows, got_steps = step_logits(gpu, ids, chunk, decode)
    replay_routing(cpu, tape, monkeypatch)
    want_rows, want_steps = step_logits(cpu, ids, chunk, decode)
    assert np.isfinite(got_rows).all() and np.isfinite(got_steps).all()
    kind = "hybrid" if shape.hybrid else "plain"
    products = chunk > MAX_GEMV_TOKENS
    after = AFTER_PRODUCTS_BOUND[kind] if products else GEMV_BOUND[kind]
    errors = {"first chunk": (relative_error(got_rows[:chunk], want_rows[:chunk]),
                              PRODUCT_BOUND[kind] if products else GEMV_BOUND[kind]),
              "short chunk": (relative_error(got_rows[chunk:], want_rows[chunk:]), after),
              "decode": (relative_error(got_steps, want_steps), after)}
    assert all(0 < error <= bound for error, bound in errors.values()), errors
