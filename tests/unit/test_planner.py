"""The planner on real model shapes: the KV reservation rules, expert placement, errors, and
`model_sizes` against the tensor sizes of a real GGUF file.

Expert sizes are Q4_K-like: 4.5 bits per weight, so one expert of 3 matrices F x H takes
3·F·H·9/16 bytes. Non-expert bytes: embeddings and output head, attention at the same 4.5 bits,
f32 routers.
"""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from moerun.backends.kv_types import KVTypes
from moerun.gguf.reader import GGUFFile
from moerun.models import load_spec
from moerun.moe.placement import PARENT, load_placement
from moerun.moe.planner import (
    DeviceBudget,
    ModelSizes,
    PlanError,
    PlanRequest,
    explain,
    model_sizes,
    plan,
)
from tests.support.hf_models import tiny_model
from tests.support.to_gguf import write_gguf

GiB, MiB = 1 << 30, 1 << 20
RESERVED_ON_EVERY_DEVICE = 768 * MiB  # default workspace 256 MiB + safety 512 MiB


def q4k(n_weights: int) -> int:
    return n_weights * 9 // 16


def moe_shape(n_layers, n_experts, top_k, hidden, expert_ff, n_heads, n_kv_heads, head_dim, vocab) -> ModelSizes:
    attention = q4k(hidden * head_dim * (2 * n_heads + 2 * n_kv_heads))  # q, o and k, v
    router = 4 * n_experts * hidden
    kv_elements = n_layers * n_kv_heads * 2 * head_dim
    return ModelSizes(
        n_layers=n_layers,
        n_experts=n_experts,
        n_experts_used=top_k,
        moe_layers=(True,) * n_layers,
        expert_bytes=(q4k(3 * expert_ff * hidden),) * n_layers,
        non_expert_bytes=2 * q4k(vocab * hidden) + n_layers * (attention + router),
        kv_values_per_token=(kv_elements // 2, kv_elements // 2),
    )


# Qwen3-30B-A3B's layer (hidden 2048, 128 experts of width 768, top-8, 32 query and 4 KV heads
# of 128, vocab 151936) in a 40-layer stack: 40·4·256·2 B = 80 KiB of KV per token at f16.
QWEN3_40L = moe_shape(40, 128, 8, 2048, 768, 32, 4, 128, 151936)
# Qwen3-30B-A3B itself: 48 layers, 96 KiB per token at f16.
QWEN3_30B = moe_shape(48, 128, 8, 2048, 768, 32, 4, 128, 151936)
# Mixtral-8x7B: 32 layers, 8 experts of width 14336, top-2, 32 query and 8 KV heads of 128:
# twice the KV heads over fewer layers, 128 KiB per token at f16.
MIXTRAL = moe_shape(32, 8, 2, 4096, 14336, 32, 8, 128, 32000)

QWEN3_EXPERT = 2_654_208         # 3·768·2048·9/16
QWEN3_40L_EXPERTS = 40 * 128     # 5120 experts, 12.66 GiB
MIXTRAL_EXPERT = 99_090_432      # 3·14336·4096·9/16; 256 experts, 23.63 GiB

PARENT_24G = DeviceBudget("parent", 24 * GiB, is_parent=True)
DAEMON_24G = DeviceBudget("cuda:1", 24 * GiB)


def request(sizes=QWEN3_40L, context=65536, kv_pool=None, parent=PARENT_24G, daemons=(DAEMON_24G,), **more):
    return PlanRequest(sizes=sizes, parent=parent, daemons=daemons, context=context, kv_pool=kv_pool, **more)


def parent_reserved(sizes: ModelSizes, kv_tokens: int) -> int:
    """Parent bytes not for experts: weights, f16 KV for kv_tokens, workspace and safety margin."""
    return sizes.non_expert_bytes + sizes.kv_token_bytes(KVTypes("f16", "f16")) * kv_tokens + RESERVED_ON_EVERY_DEVICE


def parent_budget(sizes: ModelSizes, capacity: int, kv_tokens: int) -> int:
    return capacity - parent_reserved(sizes, kv_tokens)


def test_model_shapes():
    assert QWEN3_40L.expert_bytes[0] == QWEN3_EXPERT and MIXTRAL.expert_bytes[0] == MIXTRAL_EXPERT
    assert QWEN3_40L.kv_token_bytes(KVTypes("f16", "f16")) == 80 * 1024
    assert QWEN3_30B.kv_token_bytes(KVTypes("f16", "f16")) == 96 * 1024
    assert MIXTRAL.kv_token_bytes(KVTypes("f16", "f16")) == 128 * 1024
    assert QWEN3_40L.non_expert_bytes == 816_676_864   # 779 MiB


# --- the KV reservation rules, on a 24 GiB card with a 24 GiB daemon --------------------------------

def test_64k_without_pool_reserves_full_context_and_keeps_every_expert():
    # budget: 24 GiB - 779 MiB - 5 GiB KV - 768 MiB = 17.49 GiB for 12.66 GiB of experts
    result = plan(request(context=65536))
    assert (result.kv_reserved_tokens, result.kv_reserved_bytes) == (65536, 5 * GiB)
    assert result.kv_rule == "full context" and not result.pool_redundant
    parent, daemon = result.devices
    assert (parent.n_experts, daemon.n_experts) == (QWEN3_40L_EXPERTS, 0)
    assert parent.traffic_share == 1.0 and daemon.used_bytes == 0
    assert "rule: full context" in explain(result)


def test_64k_with_49k_pool_keeps_full_context_and_calls_the_pool_redundant():
    result = plan(request(context=65536, kv_pool=49152))
    assert result.kv_reserved_tokens == 65536 and result.pool_redundant
    assert result.devices[0].n_experts == QWEN3_40L_EXPERTS
    assert "every expert on the parent" in result.kv_rule
    assert "redundant" in explain(result) and "--kv-pool" in explain(result)


def test_128k_with_49k_pool_reserves_the_pool_and_keeps_every_expert():
    # full context: 10 GiB of KV leaves 12.49 GiB, 68 experts short; the pool's 3.75 GiB leaves 18.74 GiB
    result = plan(request(context=131072, kv_pool=49152))
    assert (result.kv_reserved_tokens, result.kv_reserved_bytes) == (49152, 49152 * 80 * 1024)
    assert result.kv_rule == "bounded pool: full context would push 68 experts off the parent"
    assert not result.pool_redundant
    assert [d.n_experts for d in result.devices] == [QWEN3_40L_EXPERTS, 0]
    assert "bounded pool" in explain(result)


def test_128k_without_pool_pushes_experts_onto_the_daemon():
    budget = parent_budget(QWEN3_40L, 24 * GiB, 131072)
    assert budget == 13_410_402_304 and budget // QWEN3_EXPERT == 5052
    result = plan(request(context=131072))
    assert result.kv_reserved_tokens == 131072 and result.kv_rule == "full context"
    parent, daemon = result.devices
    assert (parent.n_experts, daemon.n_experts) == (5052, 68)
    assert (parent.used_bytes, daemon.used_bytes) == (5052 * QWEN3_EXPERT, 68 * QWEN3_EXPERT)
    assert parent.budget_bytes == budget and daemon.budget_bytes == 24 * GiB - RESERVED_ON_EVERY_DEVICE
    assert daemon.traffic_share == pytest.approx(68 / 5120)
    # uniform counts tie everywhere: ties go by (layer, expert), so the cold experts are the last
    # layer's last 68 and only that layer needs the daemon
    homes = result.placement.homes
    assert all(np.all(homes[layer] == PARENT) for layer in range(39))
    assert np.all(homes[39][:60] == PARENT) and np.all(homes[39][60:] == 0)


@pytest.mark.parametrize("context, pool, parent_experts", [(65536, 65536, 5120), (65536, 131072, 5120),
                                                            (131072, 131072, 5052), (131072, 200000, 5052)])
def test_pool_at_least_the_context_is_no_reduction(context, pool, parent_experts):
    result = plan(request(context=context, kv_pool=pool))
    assert result.kv_reserved_tokens == context
    assert result.kv_rule.startswith("pool >= context: full context")
    assert result.devices[0].n_experts == parent_experts
    assert result.pool_redundant == (parent_experts == QWEN3_40L_EXPERTS)


def test_pool_that_brings_no_expert_back_keeps_full_context():
    # at 128K the parent has 1_343_488 B spare; 15 tokens of KV (1_228_800 B) do not make an expert's 2_654_208 B
    assert parent_budget(QWEN3_40L, 24 * GiB, 131072) - 5052 * QWEN3_EXPERT == 1_343_488
    result = plan(request(context=131072, kv_pool=131072 - 15))
    assert result.kv_reserved_tokens == 131072
    assert "keeps no more experts on the parent" in result.kv_rule
    # 16 tokens of KV do make one more expert: then the pool is reserved
    result = plan(request(context=131072, kv_pool=131072 - 16))
    assert result.kv_reserved_tokens == 131072 - 16
    assert result.kv_rule == "bounded pool: full context would push 1 expert off the parent"
    assert result.devices[0].n_experts == 5053


def test_mixtral_with_a_16k_pool_reserves_the_pool():
    # 32K context: 4 GiB of KV leaves 18.41 GiB = 199 experts; the 16K pool's 2 GiB leaves 20.41 GiB = 221
    assert parent_budget(MIXTRAL, 24 * GiB, 32768) // MIXTRAL_EXPERT == 199
    assert parent_budget(MIXTRAL, 24 * GiB, 16384) // MIXTRAL_EXPERT == 221
    full = plan(request(MIXTRAL, context=32768))
    assert [d.n_experts for d in full.devices] == [199, 57]
    pooled = plan(request(MIXTRAL, context=32768, kv_pool=16384))
    assert (pooled.kv_reserved_tokens, pooled.kv_reserved_bytes) == (16384, 2 * GiB)
    assert pooled.kv_rule == "bounded pool: full context would push 22 experts off the parent"
    assert [d.n_experts for d in pooled.devices] == [221, 35]
    assert pooled.devices[0].traffic_share == pytest.approx(221 / 256)
    assert "rule: bounded pool" in explain(pooled)


def test_full_context_that_does_not_fit_falls_back_to_the_pool():
    # a 12 GiB parent cannot even hold 10 GiB of KV plus the weights and the floor; a 32K pool can
    small_parent = DeviceBudget("parent", 12 * GiB, is_parent=True)
    with pytest.raises(PlanError):
        plan(request(context=131072, parent=small_parent))
    result = plan(request(context=131072, kv_pool=32768, parent=small_parent))
    assert result.kv_reserved_tokens == 32768
    assert result.kv_rule == "bounded pool: full-context KV (131072 tokens) does not fit"
    expected = parent_budget(QWEN3_40L, 12 * GiB, 32768) // QWEN3_EXPERT
    assert [d.n_experts for d in result.devices] == [expected, QWEN3_40L_EXPERTS - expected]


def test_f32_kv_reserves_twice_the_f16_bytes():
    half, full = (plan(request(context=16384, kv_types=KVTypes(dtype, dtype))) for dtype in ("f16", "f32"))
    assert full.kv_reserved_bytes == 2 * half.kv_reserved_bytes == 16384 * 40 * 4 * 256 * 4
    assert "at f32" in explain(full)


# --- placement ---------------------------------------------------------------------------------------

def zipf_counts(sizes: ModelSizes, seed: int) -> np.ndarray:
    """[L, E] routed-pair counts, skewed as real profiles are, a different hot set per layer."""
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(sizes.n_experts) for _ in range(sizes.n_layers)]) + 1
    return (100_000 / ranks).astype(np.int64)


def test_routing_counts_put_the_busiest_experts_on_the_parent():
    counts = zipf_counts(QWEN3_30B, seed=1)
    parent = DeviceBudget("parent", 12 * GiB, is_parent=True)
    result = plan(request(QWEN3_30B, context=32768, parent=parent, routing_counts=counts))
    on_parent = np.stack([result.placement.homes[layer] == PARENT for layer in range(48)])
    expected = parent_budget(QWEN3_30B, 12 * GiB, 32768) // QWEN3_EXPERT
    assert on_parent.sum() == expected == result.devices[0].n_experts
    # every expert size is equal, so traffic per byte is traffic: the parent holds the top counts
    assert counts[on_parent].min() >= counts[~on_parent].max()
    assert result.devices[0].traffic_share == pytest.approx(counts[on_parent].sum() / counts.sum())
    assert result.devices[0].traffic_share > on_parent.mean()


def test_floor_takes_each_layers_busiest_experts():
    # a parent with room for exactly the floor: 8 experts per layer, the 8 busiest of that layer
    counts = zipf_counts(QWEN3_30B, seed=2)
    parent = DeviceBudget("parent", parent_reserved(QWEN3_30B, 4096) + 8 * 48 * QWEN3_EXPERT, is_parent=True)
    result = plan(request(QWEN3_30B, context=4096, parent=parent, routing_counts=counts))
    for layer in range(48):
        hot = np.flatnonzero(result.placement.homes[layer] == PARENT)
        np.testing.assert_array_equal(np.sort(hot), np.sort(np.argsort(-counts[layer], kind="stable")[:8]))


def test_daemons_fill_in_proportion_to_their_budgets():
    # experts beyond the floor go to the daemon left least full, by share of its budget
    parent = DeviceBudget("parent", 4 * GiB, is_parent=True)
    small, large = DeviceBudget("cpu", RESERVED_ON_EVERY_DEVICE + 2 * GiB), DeviceBudget("cuda:1", 24 * GiB)
    result = plan(request(QWEN3_30B, context=4096, parent=parent, daemons=(small, large)))
    _, on_small, on_large = result.devices
    assert on_small.n_experts + on_large.n_experts == 48 * 128 - result.devices[0].n_experts
    fill_small, fill_large = on_small.used_bytes / on_small.budget_bytes, on_large.used_bytes / on_large.budget_bytes
    assert abs(fill_small - fill_large) < QWEN3_EXPERT / on_small.budget_bytes
    assert result.placement.daemon_specs == ("cpu", "cuda:1")


def test_same_inputs_same_plan():
    counts = zipf_counts(QWEN3_30B, seed=3)

    def make():
        return plan(request(QWEN3_30B, context=65536, kv_pool=8192, routing_counts=counts.copy(),
                            parent=DeviceBudget("parent", 16 * GiB, is_parent=True)))
    first, second = make(), make()
    assert first.placement.to_json() == second.placement.to_json()
    assert first.devices == second.devices and explain(first) == explain(second)


def test_explain_prints_a_row_per_device_and_the_kv_rule():
    lines = explain(plan(request(context=131072))).splitlines()
    assert lines[0].split() == ["device", "capacity", "reserved", "expert", "budget", "expert", "bytes",
                                "experts", "traffic"]
    assert lines[1].split()[0] == "parent" and lines[1].split()[-2:] == ["5052", "98.7%"]
    assert lines[2].split()[0] == "cuda:1" and lines[2].split()[-2:] == ["68", "1.3%"]
    assert lines[3] == "KV cache: 131072 tokens at f16 (10.00 GiB) reserved on the parent; rule: full context"
    assert len(lines) == 4


# --- errors ------------------------------------------------------------------------------------------

def test_parent_too_small_for_the_floor():
    # 3 GiB - 868 MiB of weights - 768 MiB of KV - 768 MiB leaves 668 MiB; the floor, 8 x 48 experts, needs 972 MiB
    parent = DeviceBudget("parent", 3 * GiB, is_parent=True)
    short = 8 * 48 * QWEN3_EXPERT - parent_budget(QWEN3_30B, 3 * GiB, 8192)
    with pytest.raises(PlanError) as error:
        plan(request(QWEN3_30B, context=8192, parent=parent))
    message = str(error.value)
    assert "floor of 8 experts in each of 48 MoE layers (972.0 MiB)" in message
    assert f"({short:,} bytes) short" in message and "KV for 8192 tokens at f16 (768.0 MiB)" in message
    assert "--ctx" in message and "--kv-pool" in message


def test_total_capacity_too_small_names_the_missing_bytes():
    # 68 experts leave the parent at 128K; a daemon with 100 MiB of budget takes 39 of them
    tiny_daemon = DeviceBudget("cpu", RESERVED_ON_EVERY_DEVICE + 100 * MiB)
    with pytest.raises(PlanError) as error:
        plan(request(context=131072, daemons=(tiny_daemon,)))
    assert f"29 experts (73.4 MiB, {29 * QWEN3_EXPERT:,} bytes) have no room" in str(error.value)
    assert "--daemon" in str(error.value)
    with pytest.raises(PlanError, match=f"68 experts .* {68 * QWEN3_EXPERT:,} bytes"):
        plan(request(context=131072, daemons=()))


@pytest.mark.parametrize("change, problem", [
    ({"routing_counts": np.ones((40, 64))}, r"routing counts have shape \(40, 64\)"),
    ({"routing_counts": np.zeros((40, 128))}, "no routed pairs"),
    ({"routing_counts": -np.ones((40, 128))}, "not negative"),
    ({"kv_pool": 0}, "at least 1 token"),
])
def test_bad_requests(change, problem):
    with pytest.raises(PlanError, match=problem):
        plan(dataclasses.replace(request(), **change))


# --- model_sizes from a real GGUF --------------------------------------------------------------------

@pytest.mark.parametrize("arch, ftype, overrides, fused", [
    ("qwen3moe", "Q8_0", {}, False),
    ("qwen3moe", "F16", {"mlp_only_layers": [0]}, True),   # a dense first layer; gate+up fused
    ("qwen2moe", "Q4_0", {}, False),                       # a shared expert, which the parent holds
    ("mixtral", "F32", {}, False),
])
def test_model_sizes_match_the_files_tensors(tmp_path, arch, ftype, overrides, fused):
    model = tiny_model(arch, **overrides)
    path = write_gguf(model, tmp_path / "model.gguf", ftype, fused_gate_up=fused)
    config = model.config
    n_experts = getattr(config, "num_experts", None) or config.num_local_experts
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    by_layer, non_expert = [0] * config.num_hidden_layers, 0
    for tensor in gguf.GGUFReader(path).tensors:   # the gguf package's own reader as the oracle
        if tensor.name.endswith("_exps.weight"):
            by_layer[int(tensor.name.split(".")[1])] += int(tensor.n_bytes)
        else:
            non_expert += int(tensor.n_bytes)
    kv_elements = config.num_hidden_layers * config.num_key_value_heads * 2 * head_dim

    with GGUFFile(path) as file:
        spec = load_spec(file)
        sizes = model_sizes(file, spec)
    assert sizes.expert_bytes == tuple(nbytes // n_experts for nbytes in by_layer)
    assert sizes.non_expert_bytes == non_expert
    assert sizes.kv_values_per_token == (kv_elements // 2, kv_elements // 2)
    assert (sizes.n_layers, sizes.n_experts, sizes.n_experts_used) == (3, n_experts, config.num_experts_per_tok)
    assert sizes.moe_layers == tuple(layer not in overrides.get("mlp_only_layers", []) for layer in range(3))
    assert (sizes.expert_bytes[0] == 0) == bool(overrides)

    # a plan for this file loads back as a placement file for it
    half = sum(sizes.expert_bytes) * n_experts // 2
    parent = DeviceBudget("parent", sizes.non_expert_bytes + sizes.kv_token_bytes(KVTypes("f16", "f16")) * 64 + half,
                          is_parent=True)
    result = plan(PlanRequest(sizes, parent, (DeviceBudget("cpu", 1 << 20),), context=64,
                              safety_bytes=0, workspace_bytes=0))
    assert result.devices[1].n_experts > 0
    placement_file = tmp_path / "placement.json"
    placement_file.write_text(result.placement.to_json("fingerprint"))
    loaded = load_placement(placement_file, spec, ["cpu"], "fingerprint")
    assert {layer: homes.tolist() for layer, homes in loaded.homes.items()} == \
           {layer: homes.tolist() for layer, homes in result.placement.homes.items()}


def test_a_hybrid_models_sizes_count_its_recurrent_states_once_per_sequence(tmp_path):
    """qwen35moe: KV per token on its attention layer only; the DeltaNet layers' states, f32
    [HV, DK, DV] and the convolution's last W-1 inputs, reserved once whatever the context."""
    model = tiny_model("qwen35moe")
    path = write_gguf(model, tmp_path / "model.gguf", "F32")
    config = model.config
    with GGUFFile(path) as file:
        spec = load_spec(file)
        sizes = model_sizes(file, spec)
    channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim \
        + config.linear_num_value_heads * config.linear_value_head_dim
    per_layer = 4 * (config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
                     + (config.linear_conv_kernel_dim - 1) * channels)
    assert sizes.state_bytes == 3 * per_layer                      # layers 0-2 are DeltaNet, 3 attention
    assert sizes.kv_token_bytes(KVTypes("f32", "f32")) == 4 * config.num_key_value_heads * 2 * config.head_dim
    parent = DeviceBudget("parent", 1 << 30, is_parent=True)
    result = plan(PlanRequest(sizes, parent, (), context=100, kv_types=KVTypes("f32", "f32"), safety_bytes=0,
                              workspace_bytes=0))
    assert result.kv_reserved_bytes == 100 * sizes.kv_token_bytes(KVTypes("f32", "f32")) + sizes.state_bytes
