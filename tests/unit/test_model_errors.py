"""Models moerun cannot run end in one clear `Error:` line naming the file, never a traceback."""
from __future__ import annotations

import pytest

from tests.support.gguf_edit import rewrite_gguf
from tests.support.hf_models import tiny_model
from tests.support.to_gguf import write_gguf


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    return write_gguf(tiny_model("qwen3moe"), tmp_path_factory.mktemp("models") / "good.gguf", "Q8_0")


def assert_clear_error(result, path, *phrases: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    message = result.stderr.strip()
    assert message.startswith("Error: ") and "\n" not in message, message
    assert str(path) in message
    for phrase in phrases:
        assert phrase in message, message


def run_logits(moerun, path, tmp_path):
    return moerun("logits", "-m", path, "--ids", "1,2,3", "-o", tmp_path / "out.npy")


def test_the_unedited_copy_runs(good_model, tmp_path, moerun):
    copy = rewrite_gguf(good_model, tmp_path / "copy.gguf")
    assert run_logits(moerun, copy, tmp_path).exit_code == 0


def test_unsupported_architecture(good_model, tmp_path, moerun):
    path = rewrite_gguf(good_model, tmp_path / "gpt2.gguf", set_strings={"general.architecture": "gpt2"})
    assert_clear_error(run_logits(moerun, path, tmp_path), path, "unsupported architecture 'gpt2'")


def test_dense_llama_is_refused(tmp_path, moerun):
    src = write_gguf(tiny_model("mixtral"), tmp_path / "mixtral.gguf", "F32")
    routers = tuple(f"blk.{i}.ffn_gate_inp.weight" for i in range(3))
    path = rewrite_gguf(src, tmp_path / "dense.gguf", drop_tensors=routers)
    assert_clear_error(run_logits(moerun, path, tmp_path), path, "mixture-of-experts")


@pytest.mark.parametrize("tensor", ["blk.1.ffn_down_exps.weight", "blk.2.attn_k.weight", "output_norm.weight",
                                    "token_embd.weight", "blk.0.ffn_up_exps.weight"])
def test_missing_tensor(good_model, tmp_path, moerun, tensor):
    path = rewrite_gguf(good_model, tmp_path / "missing.gguf", drop_tensors=(tensor,))
    assert_clear_error(run_logits(moerun, path, tmp_path), path, tensor)


@pytest.mark.parametrize("key", ["qwen3moe.block_count", "qwen3moe.embedding_length",
                                 "qwen3moe.attention.layer_norm_rms_epsilon", "qwen3moe.expert_used_count"])
def test_missing_hyperparameter(good_model, tmp_path, moerun, key):
    path = rewrite_gguf(good_model, tmp_path / "nokey.gguf", drop_keys=(key,))
    assert_clear_error(run_logits(moerun, path, tmp_path), path, key)


def test_leading_dense_count_contradicting_tensors(good_model, tmp_path, moerun):
    path = rewrite_gguf(good_model, tmp_path / "lead.gguf", set_uint32={"qwen3moe.leading_dense_block_count": 1})
    assert_clear_error(run_logits(moerun, path, tmp_path), path, "leading_dense_block_count")


def test_unsupported_rope_scaling(good_model, tmp_path, moerun):
    path = rewrite_gguf(good_model, tmp_path / "yarn.gguf", set_strings={"qwen3moe.rope.scaling.type": "yarn"})
    assert_clear_error(run_logits(moerun, path, tmp_path), path, "rope scaling 'yarn'")


def test_not_a_gguf_file(tmp_path, moerun):
    path = tmp_path / "notes.gguf"
    path.write_text("just some text, not a model\n" * 10)
    assert_clear_error(run_logits(moerun, path, tmp_path), path)


def test_missing_file(tmp_path, moerun):
    path = tmp_path / "absent.gguf"
    assert_clear_error(run_logits(moerun, path, tmp_path), path)



def test_unsupported_tokenizer_names_the_file(good_model, tmp_path, moerun):
    path = rewrite_gguf(good_model, tmp_path / "rwkv.gguf", set_strings={"tokenizer.ggml.model": "rwkv"})
    assert run_logits(moerun, path, tmp_path).exit_code == 0          # logits by id need no vocabulary
    assert_clear_error(moerun("run", "-m", path, "-n", "2"), path, "rwkv")
