"""What is qwen35moe's own (Qwen3.5/3.6 MoE: gated DeltaNet layers with gated attention every few
layers): its layer pattern from either metadata key, and the metadata the loader refuses. Its
logits, chunked prefill and greedy decoding against transformers' qwen3_5_moe are in
test_oracle_logits.py with the other architectures (transformers' decode runs the recurrence one
token at a time, its prefill in chunks)."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.engine.runtime import Runtime
from moerun.gguf.reader import GGUFError
from tests.oracle.test_oracle_logits import prompt_ids
from tests.support.gguf_edit import rewrite_gguf
from tests.support.hf_models import tiny_model
from tests.support.to_gguf import write_gguf


@pytest.fixture(scope="module")
def hf_model():
    return tiny_model("qwen35moe", seed=1)


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
