"""Whole models on the CPU kernels against the float32 reference engine (the same files with
every matrix dequantized to float32 and multiplied by numpy): every architecture (qwen35moe's
DeltaNet projections too), every expert type (each model's three layers mix them, gate/up of one
type and down of another), gate and up fused in one tensor (mixtral here), the dense matrices (attention, shared expert,
LM head, the token embedding's rows) in other types the kernels read; prefill in chunks and decode steps."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from moerun.backends.numpy_backend import (
    DequantizedExperts,
    QuantizedExperts,
    StoredMatrix,
)
from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.quants import RowTable
from moerun.writers.bench_model import BLOCK_FILLERS, random_blocks
from tests.support.gguf_edit import rewrite_gguf
from tests.support.hf_models import ARCHS, HYBRID_ARCHS, tiny_model
from tests.support.to_gguf import write_gguf

T = gguf.GGMLQuantizationType
# max |kernels - reference| / max |reference logit|; the project's requirement is 1e-4. Measured
# 4.2e-6 (olmoe) to 2.3e-5 (qwen2moe) with every op of a step in C: float32 in other orders of
# summation (attention's through the products' tiles moved qwen3moe 1.1e-5 -> 7.3e-6, mixtral
# 6.9e-6 -> 1.0e-5, qwen2moe 1.9e-5 -> 2.3e-5).
BOUND = 4e-5
PROMPT = np.random.default_rng(11).integers(0, 320, 20).tolist()
EXPERT_WIDTHS = {"qwen3moe": dict(moe_intermediate_size=256), "qwen2moe": dict(moe_intermediate_size=256),
                 "olmoe": dict(intermediate_size=256), "mixtral": dict(intermediate_size=256),
                 "qwen35moe": dict(moe_intermediate_size=256)}
LAYER_TYPES = {   # (gate/up, down) of layers 0, 1, 2: every type the kernels read appears
    "qwen3moe": [(T.Q4_K, T.Q6_K), (T.Q5_K, T.Q8_0), (T.Q4_0, T.Q5_1)],
    "qwen2moe": [(T.Q5_0, T.Q4_1), (T.BF16, T.F16), (T.Q6_K, T.Q4_K)],
    "olmoe": [(T.Q8_0, T.Q5_K), (T.F16, T.Q4_0), (T.Q4_1, T.BF16)],
    "mixtral": [(T.Q5_1, T.Q5_0), (T.F32, T.Q6_K), (T.Q4_K, T.Q8_0)],
    "qwen35moe": [(T.Q4_K, T.Q6_K), (T.Q5_0, T.Q8_0), (T.Q6_K, T.Q4_K), (T.Q8_0, T.Q5_K)],   # 4 layers
}
DENSE_TYPES = {       # 2-D matrices but the routers: rows of a multiple of 256 values, the others
    "qwen3moe": (T.Q4_K, T.Q8_0), "qwen2moe": (T.Q6_K, T.Q5_1), "olmoe": (T.Q5_K, T.F16), "mixtral": (T.Q4_0, T.BF16),
    "qwen35moe": (T.Q4_K, T.Q8_0)}
EXPERT_STD = 0.15     # the tiny models' weight std (random blocks get it too)


def stored_as(values: np.ndarray, ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    """values [E, N, n] as ggml_type: quantized where gguf-py can, else (K-quants) random blocks
    of the same spread."""
    if ggml_type not in BLOCK_FILLERS or ggml_type == T.Q8_0:
        return gguf.quants.quantize(values, ggml_type)
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = random_blocks(ggml_type, values.size // block_size, rng, EXPERT_STD)
    return blocks.reshape(*values.shape[:-1], values.shape[-1] // block_size * type_size)


@pytest.fixture(scope="module", params=ARCHS + HYBRID_ARCHS)
def mixed_model(request, tmp_path_factory):
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    model = tiny_model(arch, seed=5, hidden_size=256, **EXPERT_WIDTHS[arch])
    base = write_gguf(model, folder / "f32.gguf", "F32", fused_gate_up=arch == "mixtral")
    reader = gguf.GGUFReader(base)
    rng = np.random.default_rng(1)
    retyped = {}
    for tensor in reader.tensors:
        if "_exps." in tensor.name:
            layer = int(tensor.name.split(".")[1])
            ggml_type = LAYER_TYPES[arch][layer]["down" in tensor.name]
        elif len(tensor.data.shape) == 2 and "ffn_gate_inp" not in tensor.name and "ssm_conv1d" not in tensor.name:
            ggml_type = DENSE_TYPES[arch][tensor.data.shape[1] % 256 != 0]
        else:
            continue
        retyped[tensor.name] = (stored_as(np.array(tensor.data), ggml_type, rng), ggml_type)
    return rewrite_gguf(base, folder / "mixed.gguf", set_tensors=retyped)


def run(path, reference: bool, monkeypatch):
    """Prefill logits (chunks of 7) and 6 greedy tokens, on the kernels or on the reference."""
    with monkeypatch.context() as patch:
        if reference:
            patch.setattr("moerun.backends.numpy_backend.load_kernels", lambda: None)
        with Runtime(path, ubatch=7) as runtime:
            weights = runtime.model.weights
            assert isinstance(weights.experts.store, DequantizedExperts if reference else QuantizedExperts)
            assert isinstance(weights.output, np.ndarray if reference else StoredMatrix)
            assert isinstance(weights.layers[-1].attn_output, np.ndarray if reference else StoredMatrix)
            assert isinstance(weights.token_embd, RowTable if reference else StoredMatrix)   # rows looked up
            logits = runtime.logits(PROMPT)
            tokens = list(runtime.generate(PROMPT[:5], 6, SamplingParams(temperature=0.0)))
    return logits, tokens


def test_logits_equal_the_float_reference(mixed_model, monkeypatch):
    want_logits, want_tokens = run(mixed_model, True, monkeypatch)
    got_logits, got_tokens = run(mixed_model, False, monkeypatch)
    error = np.max(np.abs(got_logits - want_logits)) / np.max(np.abs(want_logits))
    assert error <= BOUND, f"{error:.1e} of the logit scale"
    assert got_tokens == want_tokens
