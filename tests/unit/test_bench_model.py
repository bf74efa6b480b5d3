"""Benchmark model files: random K-quant and Q8_0 blocks decode to the intended weights, and the
written files load and run in moerun with the tensor types their quant mix names."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from math import prod
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from moerun.engine.runtime import Runtime
from moerun.gguf.reader import GGUFFile
from moerun.models import load_spec
from moerun.writers.bench_model import (
    MIXES,
    PRESETS,
    REAL_SHAPES,
    WEIGHT_STD,
    random_blocks,
    reduced,
    tensor_plan,
    vocabulary_metadata,
    with_layers,
    write_bench_model,
)

Q = GGMLQuantizationType
SCRIPT = Path(__file__).parents[2] / "scripts" / "make_bench_model.py"


@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.Q5_1])
def test_random_blocks_decode_to_small_centred_weights(ggml_type):
    n_blocks = 1024 if ggml_type in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 8192   # ~260k weights either way
    blocks = random_blocks(ggml_type, n_blocks, np.random.default_rng(1))
    assert blocks.shape == (n_blocks, GGML_QUANT_SIZES[ggml_type][1])
    weights = quants.dequantize(blocks, ggml_type)
    assert np.isfinite(weights).all()
    assert weights.std() == pytest.approx(WEIGHT_STD, rel=0.03)
    # a scale or min bias shows up as a mean of a few percent of the std; sampling noise is ~0.2%
    assert abs(weights.mean()) < 0.01 * WEIGHT_STD
    assert np.abs(weights).max() < 5 * WEIGHT_STD


def test_random_blocks_refuse_a_type_without_a_writer():
    with pytest.raises(ValueError, match="no random block writer for Q3_K"):
        random_blocks(Q.Q3_K, 1, np.random.default_rng(0))


def test_the_qwen3_30b_preset_has_the_real_model_size():
    """llama.cpp reports 30.53 B parameters for Qwen3-30B-A3B."""
    plan = {t.name: t for t in tensor_plan(PRESETS["qwen3-30b-a3b"], MIXES["q4_k_m"])}
    assert round(sum(prod(t.shape) for t in plan.values()) / 1e9, 2) == 30.53
    assert plan["blk.47.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert plan["blk.47.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert plan["blk.0.attn_q.weight"].shape == (32 * 128, 2048)
    assert plan["blk.0.attn_k.weight"].shape == (4 * 128, 2048)
    assert plan["token_embd.weight"].shape == (151936, 2048)


def test_the_qwen36_preset_has_the_real_model_shape():
    """Qwen3.6-35B-A3B: 40 layers, every fourth gated attention, the others gated DeltaNet; about
    35 B parameters (the vocabulary's embedding and head included)."""
    plan = {t.name: t for t in tensor_plan(PRESETS["qwen3.6-35b-a3b"], MIXES["q4_k_m"])}
    assert round(sum(prod(t.shape) for t in plan.values()) / 1e9) == 35
    assert plan["blk.0.attn_qkv.weight"].shape == (2 * 16 * 128 + 32 * 128, 2048)
    assert plan["blk.0.ssm_out.weight"].shape == (2048, 32 * 128)
    assert plan["blk.3.attn_q.weight"].shape == (2 * 16 * 256, 2048)          # queries and their gates
    assert "blk.3.attn_qkv.weight" not in plan and "blk.39.attn_q.weight" in plan
    assert plan["blk.39.ffn_gate_exps.weight"].shape == (256, 512, 2048)
    assert plan["blk.0.ffn_down_shexp.weight"].shape == (2048, 512)
    assert plan["blk.0.ssm_conv1d.weight"].ggml_type == Q.F32 and plan["blk.0.ssm_a"].ggml_type == Q.F32


def test_the_tiny_hybrid_file_loads_and_runs(tmp_path):
    path = write_bench_model(tmp_path / "hybrid.gguf", PRESETS["tiny-hybrid"], MIXES["q4_k_m"], seed=1)
    with Runtime(path) as runtime:
        spec = runtime.spec
        assert spec.family == "qwen35moe" and spec.recurrent_layers == (True, True, True, False)
        assert spec.rotary_dims == 16 and spec.delta_net.value_heads == 4 and spec.shared_ff == 256
        logits = runtime.logits(runtime.tokenizer.encode("The experts") + [5, 900])
    assert np.isfinite(logits).all() and len(set(logits.argmax(axis=-1).tolist())) > 1


def test_rows_that_are_no_whole_k_quant_blocks_take_llama_cpps_fallback_types():
    """Qwen1.5-MoE's experts are 1408 wide: 5.5 blocks of 256 along the down rows."""
    plan = {t.name: t.ggml_type for t in tensor_plan(PRESETS["qwen1.5-moe-a2.7b"], MIXES["q4_k_m"])}
    assert plan["blk.0.ffn_down_exps.weight"] == Q.Q8_0                   # Q6_K's fallback
    assert plan["blk.0.ffn_gate_exps.weight"] == Q.Q4_K                   # rows of the hidden size fit
    q5 = {t.name: t.ggml_type for t in tensor_plan(PRESETS["qwen1.5-moe-a2.7b"], MIXES["q5_k_m"])}
    assert q5["blk.0.ffn_down_exps.weight"] == Q.Q8_0
    narrow = dataclasses.replace(PRESETS["tiny"], hidden=288)          # every matrix reading the hidden size
    types = {t.name: t.ggml_type for t in tensor_plan(narrow, MIXES["q5_k_m"])}
    assert types["blk.0.attn_q.weight"] == Q.Q5_1 and types["blk.0.attn_v.weight"] == Q.Q8_0


def test_a_shape_whose_rows_fit_no_block_is_refused():
    shape = dataclasses.replace(PRESETS["tiny"], expert_ff=200)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down_exps\.weight .* cannot be stored as Q8_0"):
        tensor_plan(shape, MIXES["q4_k_m"])


# llama.cpp's parameter counts (llama-bench's `params`), in billions
REAL_PARAMETERS = {"qwen3-30b-a3b": 30.53, "qwen3-235b-a22b": 235.09, "qwen3.6-35b-a3b": 34.66,
                   "mixtral-8x7b": 46.70, "qwen1.5-moe-a2.7b": 14.32, "qwen2-57b-a14b": 57.41, "olmoe-1b-7b": 6.92}


@pytest.mark.parametrize("preset", REAL_SHAPES)
def test_every_real_preset_has_its_models_parameter_count(preset):
    plan = tensor_plan(PRESETS[preset], MIXES["q4_k_m"])
    assert round(sum(prod(t.shape) for t in plan) / 1e9, 2) == REAL_PARAMETERS[preset]


# what each architecture's file holds beside the projections and the routed experts
ARCH_TENSORS = {"qwen3moe": {"attn_q_norm", "attn_k_norm"}, "olmoe": {"attn_q_norm", "attn_k_norm"},
                "qwen2moe": {"attn_q.bias", "attn_k.bias", "attn_v.bias", "ffn_gate_inp_shexp", "ffn_down_shexp"},
                "llama": set(), "qwen35moe": {"ssm_out", "ffn_gate_inp_shexp", "ffn_down_shexp"}}
FAMILIES = {"qwen3moe": "qwen3moe", "olmoe": "olmoe", "qwen2moe": "qwen2moe", "llama": "mixtral",
            "qwen35moe": "qwen35moe"}


@pytest.fixture(scope="module", params=REAL_SHAPES)
def reduced_file(request, tmp_path_factory):
    shape = reduced(PRESETS[request.param], n_layers=4 if PRESETS[request.param].hybrid else 2)
    return shape, write_bench_model(tmp_path_factory.mktemp("reduced") / f"{request.param}.gguf", shape,
                                    MIXES["q4_k_m"], seed=2)


def test_every_preset_at_reduced_width_loads_as_its_architecture(reduced_file):
    shape, path = reduced_file
    with GGUFFile(path) as gguf:
        spec = load_spec(gguf)
        roles = {name.split(".", 2)[2].removesuffix(".weight") for name in gguf.tensors if name.startswith("blk.0.")}
    assert spec.family == FAMILIES[shape.arch] and spec.n_layers == shape.n_layers
    assert (spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim_k) == (shape.hidden, shape.n_heads,
                                                                               shape.n_kv_heads, shape.head_dim)
    assert (spec.n_experts, spec.n_experts_used, spec.expert_ff) == (shape.n_experts, shape.n_experts_used,
                                                                     shape.expert_ff)
    assert spec.shared_ff == shape.shared_ff
    layer_zero = {role for role in roles if role in set().union(*ARCH_TENSORS.values())}
    assert layer_zero == ARCH_TENSORS[shape.arch]


def test_every_preset_at_reduced_width_runs(reduced_file):
    shape, path = reduced_file
    with Runtime(path) as runtime:
        logits = runtime.logits(runtime.tokenizer.encode("The experts") + [5, 900, shape.vocab - 1])
    assert np.isfinite(logits).all() and len(set(logits.argmax(axis=-1).tolist())) > 1


@pytest.fixture(scope="module", params=["q4_k_m", "q5_k_m", "q8_0"])
def tiny_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / f"tiny-{request.param}.gguf"
    return request.param, write_bench_model(path, with_layers(PRESETS["tiny"], 1), MIXES[request.param], seed=3)


def test_tiny_file_loads_with_the_preset_shape(tiny_file):
    _, path = tiny_file
    with GGUFFile(path) as gguf:
        spec = load_spec(gguf)
    tiny = PRESETS["tiny"]
    assert (spec.family, spec.n_layers, spec.hidden, spec.vocab) == ("qwen3moe", 1, tiny.hidden, tiny.vocab)
    assert (spec.n_experts, spec.n_experts_used, spec.expert_ff) == (8, 2, 256)
    assert (spec.n_heads, spec.n_kv_heads, spec.head_dim_k) == (tiny.n_heads, tiny.n_kv_heads, tiny.head_dim)
    assert (spec.rope_base, spec.rms_eps, spec.context_train) == (1e6, pytest.approx(1e-6), tiny.context)


def test_tiny_file_runs_a_forward_pass_and_tokenizes(tiny_file):
    _, path = tiny_file
    with Runtime(path) as runtime:
        ids = runtime.tokenizer.encode("The experts")
        assert runtime.tokenizer.decode(ids) == "The experts"
        logits = runtime.logits(ids + [5, 900, 1023])
    assert logits.shape == (len(ids) + 3, PRESETS["tiny"].vocab)
    assert np.isfinite(logits).all()
    assert 0.1 < logits.std(axis=-1).min() and logits.std(axis=-1).max() < 100   # neither flat nor exploding
    assert len(set(logits.argmax(axis=-1).tolist())) > 1                            # the input matters


def test_tensor_types_follow_the_mix(tiny_file):
    mix, path = tiny_file
    with GGUFFile(path) as gguf:
        types = {name: t.ggml_type for name, t in gguf.tensors.items()}
        file_type = gguf.get("general.file_type")
    assert file_type == int(MIXES[mix].file_type)
    f32 = {n for n in types if n.endswith(("norm.weight", "ffn_gate_inp.weight"))}
    assert {types[n] for n in f32} == {Q.F32}
    assert len(f32) == 6                                        # 5 per layer, output_norm
    if mix == "q8_0":
        assert {t for n, t in types.items() if n not in f32} == {Q.Q8_0}
    else:
        six_bit = {"blk.0.attn_v.weight", "blk.0.ffn_down_exps.weight", "output.weight"}
        most = Q.Q4_K if mix == "q4_k_m" else Q.Q5_K
        assert {n for n, t in types.items() if t == Q.Q6_K} == six_bit
        assert {types[n] for n in types if n not in f32 | six_bit} == {most}
        assert types["token_embd.weight"] == most


def test_the_seed_decides_the_bytes(tmp_path):
    shape, mix = with_layers(PRESETS["tiny"], 1), MIXES["q4_k_m"]
    first, again, other = (write_bench_model(tmp_path / f"{name}.gguf", shape, mix, seed=seed)
                           for name, seed in (("first", 0), ("again", 0), ("other", 1)))
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    assert first.stat().st_size == other.stat().st_size


def test_routing_spreads_over_the_experts_with_a_moderately_hot_head(tmp_path):
    """Over 512 random prompt tokens, as `moerun bench` feeds them, every layer sends some tokens
    to nearly every expert and its hottest expert a few times the mean load. With every weight
    plainly random, the hottest expert of the later layers gets nearly every token and more than
    half of the experts get none."""
    shape = dataclasses.replace(PRESETS["tiny"], n_layers=4, n_experts=128, n_experts_used=8)
    path = write_bench_model(tmp_path / "routed.gguf", shape, MIXES["q8_0"])
    with Runtime(path, ctx=512, count_routing=True) as runtime:
        runtime.logits(np.random.default_rng(0).integers(0, shape.vocab, 512).tolist())
        counts = runtime.routing_counts()                                           # [L, E]
    hottest = counts.max(axis=1) / counts.mean(axis=1)                              # [L]
    assert (2 < hottest).all() and (hottest < 6).all(), hottest
    assert ((counts > 0).mean(axis=1) >= 0.9).all(), (counts > 0).mean(axis=1)


@pytest.mark.parametrize("vocab", [300, 2000])
def test_vocabulary_has_exactly_the_requested_size(vocab):
    meta = vocabulary_metadata(vocab)
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.token_type"]) == vocab
    assert len(set(meta["tokenizer.ggml.tokens"])) == vocab
    assert "<|endoftext|>" in meta["tokenizer.ggml.tokens"]


def test_vocabulary_smaller_than_the_byte_alphabet_is_refused():
    with pytest.raises(ValueError, match="no room for the 256 bytes"):
        vocabulary_metadata(200)


def test_script_writes_a_file_and_reports_its_size(tmp_path):
    out = tmp_path / "tiny.gguf"
    done = subprocess.run([sys.executable, SCRIPT, "-o", out, "--preset", "tiny", "--layers", "1", "--mix", "q8_0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stderr and "MB/s" in done.stderr
    with GGUFFile(out) as gguf:
        assert load_spec(gguf).n_layers == 1


def test_script_refuses_zero_layers(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "-o", tmp_path / "x.gguf", "--layers", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--layers must be at least 1" in done.stderr
    assert not (tmp_path / "x.gguf").exists()
