"""qwen35moe (Qwen3.5/3.6 MoE: gated DeltaNet layers with gated attention every few layers) on
the CPU against Hugging Face transformers' qwen3_5_moe: logits of every storage type (the
oracle for a quantized file loaded with its dequantized weights), a prompt in chunks against one
chunk (the layers' states carried between chunks), greedy decoding (transformers' decode runs
the recurrence one token at a time, its prefill in chunks), and what the loader refuses."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.reader import GGUFError
from tests.oracle.test_oracle_logits import assert_close, cli_logits, hf_logits, prompt_ids
from tests.support.from_gguf import dequantized_model
from tests.support.gguf_edit import rewrite_gguf
from tests.support.hf_models import tiny_model
from tests.support.to_gguf import FTYPES, write_gguf


@pytest.fixture(scope="module")
def hf_model():
    return tiny_model("qwen35moe", seed=1)


@pytest.mark.parametrize("ftype", FTYPES)
def test_logits_match_transformers(hf_model, ftype, tmp_path, moerun):
    path = write_gguf(hf_model, tmp_path / f"model-{ftype}.gguf", ftype)
    oracle = hf_model if ftype == "F32" else dequantized_model(hf_model, path)
    ids = prompt_ids(hf_model)
    assert_close(cli_logits(moerun, path, ids, tmp_path), hf_logits(oracle, ids))


def test_quantized_file_differs_from_f32_model(hf_model, tmp_path, moerun):
    path = write_gguf(hf_model, tmp_path / "model-q4.gguf", "Q4_0")
    ids = prompt_ids(hf_model)
    got, expected = cli_logits(moerun, path, ids, tmp_path), hf_logits(hf_model, ids)
    assert np.max(np.abs(got - expected)) / np.max(np.abs(expected)) > 1e-3


def test_chunked_prefill_carries_the_states(hf_model, tmp_path, moerun):
    path = write_gguf(hf_model, tmp_path / "model.gguf", "F32")
    ids = prompt_ids(hf_model, seed=3)
    expected = hf_logits(hf_model, ids)
    for ubatch in ("5", "1"):          # chunks of 5, and one token at a time
        assert_close(cli_logits(moerun, path, ids, tmp_path, "--ubatch", ubatch), expected)


def test_greedy_generation_matches_transformers(hf_model, tmp_path):
    path = write_gguf(hf_model, tmp_path / "model.gguf", "F32")
    ids = prompt_ids(hf_model, seed=5)[:8]
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    with Runtime(path, ubatch=3) as runtime:
        got = list(runtime.generate(ids, 24, SamplingParams(temperature=0.0)))
    assert got == expected


def test_layer_pattern_from_the_interval(hf_model, tmp_path):
    """Without attention.recurrent_layers, every full_attention_interval-th layer attends."""
    path = write_gguf(hf_model, tmp_path / "model.gguf", "F32")
    ids = prompt_ids(hf_model, seed=7)
    with Runtime(path) as runtime:
        expected = runtime.logits(ids)
        assert runtime.spec.recurrent_layers == (True, True, True, False)
    rewrite_gguf(path, tmp_path / "interval.gguf", drop_keys=("qwen35moe.attention.recurrent_layers",))
    with Runtime(tmp_path / "interval.gguf") as runtime:
        assert runtime.spec.recurrent_layers == (True, True, True, False)
        np.testing.assert_array_equal(runtime.logits(ids), expected)


@pytest.mark.parametrize("change,message", [
    (dict(set_arrays={"qwen35moe.rope.dimension_sections": [2, 1, 0, 1]}), "fourth section"),
    (dict(drop_keys=("qwen35moe.ssm.group_count",)), "ssm.group_count"),
    (dict(set_uint32={"qwen35moe.ssm.time_step_rank": 3}), "multiple of"),
])
def test_refuses_bad_metadata(hf_model, tmp_path, change, message):
    path = write_gguf(hf_model, tmp_path / "model.gguf", "F32")
    rewrite_gguf(path, tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFError, match=message):
        Runtime(tmp_path / "bad.gguf")
