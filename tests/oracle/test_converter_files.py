"""Files written by llama.cpp's own converter (convert_hf_to_gguf.py, fetched once by
tests/support/llama_converter.py) from tiny Hugging Face checkpoints: moerun's logits and
greedy tokens against transformers, for every architecture, with the converter's options that
apply to them; and the converter's files against our own writer (tests/support/to_gguf.py),
which the other oracle tests use.

The converter's names, for hf_models.ARCHS:
    qwen3moe  Qwen3MoeForCausalLM -> Qwen3MoeModel, GGUF architecture qwen3moe
    qwen2moe  Qwen2MoeForCausalLM -> Qwen2MoeModel, qwen2moe (q, k, v biases)
    olmoe     OlmoeForCausalLM    -> OlmoeModel,    olmoe
    mixtral   MixtralForCausalLM  -> LlamaModel,    llama (q, k rows permuted for normal rope)
--fuse-qkv applies to all four (each lists ATTN_QKV in gguf-py's MODEL_TENSORS).
--fuse-gate-up-exps applies to none: FFN_GATE_UP_EXP is in none of their tensor lists, and the
converter stops with "Missing <MODEL_TENSOR.FFN_GATE_UP_EXP...>" (test_fused_gate_up_is_not_offered).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.reader import GGUFFile
from tests.oracle.test_oracle_logits import (
    assert_close,
    cli_logits,
    hf_logits,
    prompt_ids,
)
from tests.support.from_gguf import dequantized_model
from tests.support.fuse_qkv import fuse_qkv
from tests.support.gguf_edit import rewrite_gguf
from tests.support.hf_models import ARCHS, tiny_model
from tests.support.llama_converter import (
    ConversionFailed,
    Converter,
    ConverterUnavailable,
    fetch_converter,
    hf_checkpoint,
)
from tests.support.to_gguf import GGUF_ARCH, write_gguf

pytestmark = pytest.mark.slow   # converting checkpoints with llama.cpp's converter: ~2 min

# Converter options per file; every one of them is converted for every architecture.
VARIANTS = {
    "f32": ("--outtype", "f32"),
    "f32-fuse-qkv": ("--outtype", "f32", "--fuse-qkv"),
    "q8_0": ("--outtype", "q8_0"),
}
# Names differ: the converter derives the name and a size label (ours has no label).
NAMING_KEYS = {"general.name", "general.size_label"}


@dataclass
class Converted:
    arch: str
    model: torch.nn.Module          # the checkpoint the converter read
    files: dict[str, Path]          # VARIANTS key -> the converter's file


@pytest.fixture(scope="session")
def converter() -> Converter:
    """Fetched once (see llama_converter); no converter fails every test that needs it."""
    try:
        return fetch_converter()
    except ConverterUnavailable as err:
        problem = str(err)
    pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="module", params=ARCHS)
def converted(request, converter, tmp_path_factory) -> Converted:
    folder = tmp_path_factory.mktemp(f"converted-{request.param}")
    checkpoint = folder / "hf"
    model = hf_checkpoint(request.param, checkpoint, converter, seed=1)
    with ThreadPoolExecutor(len(VARIANTS)) as pool:       # the converter's start-up dominates
        jobs = {variant: pool.submit(converter.convert, checkpoint, folder / f"{variant}.gguf", *options)
                for variant, options in VARIANTS.items()}
    return Converted(request.param, model, {variant: job.result() for variant, job in jobs.items()})


def _open(path) -> GGUFFile:
    """moerun's reader: gguf-py's takes seconds over a 50257-token vocabulary."""
    return GGUFFile(path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(converted, variant, tmp_path, moerun):
    path = converted.files[variant]
    oracle = dequantized_model(converted.model, path) if variant == "q8_0" else converted.model
    ids = prompt_ids(converted.model)
    assert_close(cli_logits(moerun, path, ids, tmp_path), hf_logits(oracle, ids))


def test_greedy_generation_of_the_fused_file_matches_transformers(converted):
    """Prefill in chunks of 3 and one-token decode steps, through the fused projection."""
    ids = prompt_ids(converted.model, seed=5)[:8]
    with torch.no_grad():
        expected = converted.model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                            eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    with Runtime(converted.files["f32-fuse-qkv"], ubatch=3) as runtime:
        got = list(runtime.generate(ids, 32, SamplingParams(temperature=0.0)))
    assert got == expected


def test_fused_qkv_is_q_then_k_then_v(converted):
    """What the converter's --fuse-qkv writes, against its plain file."""
    fused, separate = _open(converted.files["f32-fuse-qkv"]), _open(converted.files["f32"])
    architecture = GGUF_ARCH[converted.arch]
    assert separate.metadata["general.architecture"] == fused.metadata["general.architecture"] == architecture
    suffixes = ("weight", "bias") if converted.arch == "qwen2moe" else ("weight",)
    layers = range(converted.model.config.num_hidden_layers)
    assert set(separate.tensors) - set(fused.tensors) == {f"blk.{i}.attn_{p}.{s}" for i in layers for p in "qkv"
                                                          for s in suffixes}
    assert set(fused.tensors) - set(separate.tensors) == {f"blk.{i}.attn_qkv.{s}" for i in layers for s in suffixes}
    for i in layers:
        for suffix in suffixes:
            parts = [separate.raw(f"blk.{i}.attn_{p}.{suffix}") for p in "qkv"]
            np.testing.assert_array_equal(fused.raw(f"blk.{i}.attn_qkv.{suffix}"), np.concatenate(parts))


@pytest.mark.parametrize("variant,ftype", [("f32", "F32"), ("q8_0", "Q8_0")])
def test_our_writer_writes_what_the_converter_writes(converted, variant, ftype, tmp_path):
    """Same tensors (names, types, shapes, bytes) and hyper-parameters; the tokenizer aside."""
    theirs = _open(converted.files[variant])
    ours = _open(write_gguf(converted.model, tmp_path / "ours.gguf", ftype))
    assert theirs.tensors.keys() == ours.tensors.keys()
    for name, info in theirs.tensors.items():
        assert (info.ggml_type, info.shape) == (ours.tensors[name].ggml_type, ours.tensors[name].shape), name
        assert np.array_equal(theirs.raw(name), ours.raw(name)), name
    theirs_kv, ours_kv = ({key: value for key, value in file.metadata.items()
                           if not key.startswith("tokenizer.") and key not in NAMING_KEYS} for file in (theirs, ours))
    assert theirs_kv == ours_kv


def test_fused_gate_up_is_not_offered(converter, tmp_path):
    """A converter limitation, recorded so a converter that starts offering it is noticed."""
    hf_checkpoint("qwen3moe", tmp_path / "hf", converter)
    with pytest.raises(ConversionFailed, match="FFN_GATE_UP_EXP"):
        converter.convert(tmp_path / "hf", tmp_path / "out.gguf", "--outtype", "f32", "--fuse-gate-up-exps")


# Fused files of every storage type without the converter (tests/support/fuse_qkv.py).

@pytest.mark.parametrize("arch", ARCHS)
def test_fused_quantized_file_equals_the_separate_one(arch, tmp_path):
    model = tiny_model(arch, seed=2)
    separate = write_gguf(model, tmp_path / "separate.gguf", "Q4_0")
    fused = fuse_qkv(separate, tmp_path / "fused.gguf")
    ids = prompt_ids(model, seed=7)
    with Runtime(separate) as a, Runtime(fused, ubatch=5) as b:
        want, got = a.logits(ids), b.logits(ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.max(np.abs(want)))


def test_fused_qkv_of_the_wrong_height_is_refused(tmp_path, moerun):
    fused = fuse_qkv(write_gguf(tiny_model("qwen3moe"), tmp_path / "m.gguf"), tmp_path / "fused.gguf")
    path = rewrite_gguf(fused, tmp_path / "bad.gguf", set_uint32={"qwen3moe.attention.key_length": 16})
    result = moerun("logits", "-m", path, "--ids", "1,2,3", "-o", tmp_path / "out.npy")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "'blk.0.attn_qkv.weight' has 256 rows; q, k and v need 64 + 32 + 64 = 160" in result.stderr


def test_separate_q_beside_fused_qkv_is_refused(tmp_path, moerun):
    separate = write_gguf(tiny_model("olmoe"), tmp_path / "m.gguf")
    path = fuse_qkv(separate, tmp_path / "both.gguf", keep=("blk.1.attn_q.weight",))
    result = moerun("logits", "-m", path, "--ids", "1,2,3", "-o", tmp_path / "out.npy")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "layer 1 has both 'blk.1.attn_qkv.weight' and 'blk.1.attn_q.weight'" in result.stderr
