"""Every architecture's real shape on the GPU against the CPU backend: the bench model's presets
(Mixtral's few wide experts, OLMoE's and Qwen3's many narrow ones, the shared experts of
qwen2moe, hidden sizes up to 4096, the hybrid's DeltaNet), one layer at the real width and two
at reduced width, in each quant mix; prefill in chunks of 1, 7, 64, 512 and 2048 tokens, each
followed by a short chunk against the cache it filled, then decode steps.

Bounds (module docstring of test_gpu_model.py): chunks of more than 8 tokens go through the
prefill products (f16 operands) and are held to REAL_SCALE_F16_BOUND, the weights being at real
scale; chunks of at most 8 and decode steps go through the GEMVs, held to INT_GEMV_BOUND. The GPU's
KV cache is f32, so only the kernels' own rounding counts."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.backends.gpu_kernels import MAX_GEMV_TOKENS
from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig
from moerun.writers.bench_model import MIXES, PRESETS, REAL_SHAPES, reduced, with_layers, write_bench_model
from tests.support.gpu import INT_GEMV_BOUND, gpu_device

pytestmark = pytest.mark.gpu
REAL_SCALE_F16_BOUND = 1e-3
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


def step_logits(runtime: Runtime, ids: list[int], chunk: int, decode: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Logits [T, V] of ids prefilled in chunks of `chunk` on one cache, then [S, V] of one-token steps."""
    cache = runtime.backend.new_cache(runtime.ctx)
    rows = [runtime.model.forward(np.asarray(ids[start:start + chunk]), cache, all_logits=True)
            for start in range(0, len(ids), chunk)]
    steps = [runtime.model.forward(np.array([token]), cache, all_logits=False) for token in decode]
    return np.concatenate(rows), np.concatenate(steps)


@pytest.fixture(scope="module")
def runtimes(shape_file):
    """The file on the CPU and on the GPU, with room for the longest test."""
    shape, path = shape_file
    ctx = max(CHUNKS) + SHORT_CHUNK + DECODE_STEPS
    with Runtime(path, ctx=ctx, rig=RigConfig(device="cpu")) as cpu, \
            Runtime(path, ctx=ctx, rig=RigConfig(device=gpu_device(), kv_dtype="f32")) as gpu:
        yield shape, cpu, gpu


@pytest.mark.parametrize("chunk", CHUNKS)
def test_prefill_chunks_and_decode_match_the_cpu(runtimes, chunk):
    shape, cpu, gpu = runtimes
    rng = np.random.default_rng(chunk)
    ids = rng.integers(0, shape.vocab, chunk + SHORT_CHUNK).tolist()
    decode = rng.integers(0, shape.vocab, DECODE_STEPS).tolist()
    want_rows, want_steps = step_logits(cpu, ids, chunk, decode)
    got_rows, got_steps = step_logits(gpu, ids, chunk, decode)
    assert np.isfinite(got_rows).all() and np.isfinite(got_steps).all()
    first_bound = REAL_SCALE_F16_BOUND if chunk > MAX_GEMV_TOKENS else INT_GEMV_BOUND
    errors = {"first chunk": (relative_error(got_rows[:chunk], want_rows[:chunk]), first_bound),
              "short chunk": (relative_error(got_rows[chunk:], want_rows[chunk:]), INT_GEMV_BOUND),
              "decode": (relative_error(got_steps, want_steps), INT_GEMV_BOUND)}
    assert all(0 < error <= bound for error, bound in errors.values()), errors
