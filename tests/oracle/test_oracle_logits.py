"""moerun's logits and greedy tokens against Hugging Face transformers, for every
architecture and storage type. The oracle for a quantized file is the transformers
model loaded with that file's dequantized weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from tests.support.from_gguf import dequantized_model
from tests.support.hf_models import ARCHS, HYBRID_ARCHS, tiny_model
from tests.support.to_gguf import FTYPES, write_gguf

PROMPT_LEN = 24
RELATIVE_BOUND = 1e-4   # max |moerun - oracle| over max |oracle logit|


@pytest.fixture(scope="module", params=ARCHS + HYBRID_ARCHS)
def hf_model(request):
    return tiny_model(request.param, seed=1)


def prompt_ids(model, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, PROMPT_LEN).tolist()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def cli_logits(moerun, path, ids, tmp_path, *extra) -> np.ndarray:
    out = tmp_path / "logits.npy"
    result = moerun("logits", "-m", path, "--ids", ",".join(map(str, ids)), "-o", out, *extra)
    assert result.exit_code == 0, result.output
    return np.load(out)


def assert_close(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == expected.shape
    error = np.max(np.abs(got - expected)) / np.max(np.abs(expected))
    assert error <= RELATIVE_BOUND, f"max error {error:.2e} of the logit scale"


@pytest.mark.parametrize("ftype", FTYPES)
def test_logits_match_transformers(hf_model, ftype, tmp_path, moerun):
    path = write_gguf(hf_model, tmp_path / f"model-{ftype}.gguf", ftype)
    oracle = hf_model if ftype == "F32" else dequantized_model(hf_model, path)
    ids = prompt_ids(hf_model)
    assert_close(cli_logits(moerun, path, ids, tmp_path), hf_logits(oracle, ids))


def test_quantized_file_differs_from_f32_model(hf_model, tmp_path, moerun):
    """The quantized comparisons above are not vacuous: Q4_0 moves the logits."""
    path = write_gguf(hf_model, tmp_path / "model-q4.gguf", "Q4_0")
    ids = prompt_ids(hf_model)
    got = cli_logits(moerun, path, ids, tmp_path)
    expected = hf_logits(hf_model, ids)
    assert np.max(np.abs(got - expected)) / np.max(np.abs(expected)) > 10 * RELATIVE_BOUND


def test_chunked_prefill_equals_one_chunk(hf_model, tmp_path, moerun):
    path = write_gguf(hf_model, tmp_path / "model.gguf", "F32")
    ids = prompt_ids(hf_model, seed=3)
    whole = cli_logits(moerun, path, ids, tmp_path)
    chunked = cli_logits(moerun, path, ids, tmp_path, "--ubatch", "3")
    assert_close(chunked, hf_logits(hf_model, ids))
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-5 * np.max(np.abs(whole)))


def test_fused_gate_up_experts(hf_model, tmp_path, moerun):
    path = write_gguf(hf_model, tmp_path / "fused.gguf", "F32", fused_gate_up=True)
    ids = prompt_ids(hf_model, seed=4)
    assert_close(cli_logits(moerun, path, ids, tmp_path), hf_logits(hf_model, ids))


def test_greedy_generation_matches_transformers(hf_model, tmp_path):
    path = write_gguf(hf_model, tmp_path / "model.gguf", "F32")
    ids = prompt_ids(hf_model, seed=5)[:8]
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    runtime = Runtime(path, ubatch=3)
    got = list(runtime.generate(ids, 32, SamplingParams(temperature=0.0)))
    runtime.close()
    assert got == expected


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
@pytest.mark.parametrize("layout", [dict(mlp_only_layers=[0]), dict(decoder_sparse_step=2)],
                         ids=["leading-dense", "sparse-step"])
def test_dense_ffn_layers(arch, layout, tmp_path, moerun):
    model = tiny_model(arch, seed=2, intermediate_size=64, **layout)
    path = write_gguf(model, tmp_path / "dense.gguf", "Q8_0")
    ids = prompt_ids(model, seed=6)
    assert_close(cli_logits(moerun, path, ids, tmp_path), hf_logits(dequantized_model(model, path), ids))
