"""Fused attention projections (llama.cpp's converter with --fuse-qkv) on the GPU backend: a
file whose q, k and v are fused by tests/support/fuse_qkv.py gives the separate file's logits.
q, k and v are then column slices of one [T, N] result, strided when T > 1: checked through the
f16 products of a prefill chunk (T > 8), the f32 GEMVs of a small chunk (1 < T <= 8) and
captured one-token decode steps (one row, contiguous), in each storage type; and the fused
file against the numpy backend with test_gpu_model's bounds."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.engine.sampler import SamplingParams
from tests.gpu.test_gpu_model import ORACLE_F16_BOUND, prompt, relative_error, runtime
from tests.support.fuse_qkv import fuse_qkv
from tests.support.gpu import gemv_bound, gpu_device
from tests.support.hf_models import ARCHS, tiny_model
from tests.support.to_gguf import write_gguf

pytestmark = pytest.mark.gpu
FTYPES = ("F32", "Q8_0", "Q4_0")
# Relative error, fused against separate. The GEMVs compute each row alike whatever the matrix
# height (bit-identical on an H100). cuBLAS may multiply the taller fused matrix with another
# kernel, summing in another order, which the tiny models' sharp routing amplifies (5.8e-5 on an
# H100 for qwen3moe F32, all else bit-identical); a wrong split would be off by order 1.
GEMV_BOUND = 1e-5
PRODUCTS_BOUND = 5e-4


@pytest.fixture(scope="module", params=ARCHS)
def files(request, tmp_path_factory):
    """ftype -> (separate, fused) files of one model."""
    model = tiny_model(request.param, seed=3)
    folder = tmp_path_factory.mktemp(f"fused-{request.param}")
    pairs = {}
    for ftype in FTYPES:
        separate = write_gguf(model, folder / f"{ftype}.gguf", ftype)
        pairs[ftype] = (separate, fuse_qkv(separate, folder / f"{ftype}-fused.gguf"))
    return pairs


@pytest.mark.parametrize("ftype", FTYPES)
def test_fused_prefill_logits_equal_separate(files, ftype):
    separate, fused = files[ftype]
    ids = prompt()
    with runtime(separate, gpu_device()) as a, runtime(fused, gpu_device()) as b, runtime(fused, "cpu") as cpu:
        assert relative_error(b.logits(ids), a.logits(ids)) <= PRODUCTS_BOUND       # one chunk of 24
        for chunk in (ids[:8], ids[:3]):                                                # f32 GEMVs
            assert relative_error(b.logits(chunk), a.logits(chunk)) <= GEMV_BOUND, len(chunk)
        want = cpu.logits(ids)
        assert 0 < relative_error(b.logits(ids), want) <= ORACLE_F16_BOUND
        assert relative_error(b.logits(ids[:8]), want[:8]) <= gemv_bound(ftype)


def test_fused_decode_steps_equal_separate(files):
    """Captured and replayed one-token steps after a prefill chunk of 8 (GEMVs throughout)."""
    def decode_logits(path) -> np.ndarray:
        with runtime(path, gpu_device()) as gpu:
            cache = gpu.backend.new_cache(gpu.ctx)
            logits = [gpu.model.forward(np.array(prompt(2)[:8]), cache, all_logits=True)]
            for token in range(10, 20):
                logits.append(gpu.model.forward(np.array([token]), cache, all_logits=False))
            return np.concatenate(logits)

    separate, fused = files["Q8_0"]
    assert relative_error(decode_logits(fused), decode_logits(separate)) <= GEMV_BOUND


def test_fused_greedy_tokens_equal_separate(files):
    greedy = SamplingParams(temperature=0.0)
    separate, fused = files["Q4_0"]
    with runtime(separate, gpu_device(), ubatch=8) as a, runtime(fused, gpu_device(), ubatch=8) as b:
        want = list(a.generate(prompt(1), 48, greedy))
        got = list(b.generate(prompt(1), 48, greedy))
    assert got == want and len(got) == 48
