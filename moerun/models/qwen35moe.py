"""qwen35moe (Qwen3.5/3.6 MoE): a hybrid. Most layers are gated DeltaNet (linear attention);
every few (`full_attention_interval`, or as `attention.recurrent_layers` lists) attend, with
gated attention: attn_q gives each head's query and an output gate, per-head q/k RMSNorm, NEOX
rope over the first `rope.dimension_count` dims of a head. Routed experts whose top-K weights
are renormalised, beside a shared expert scaled by sigmoid(ffn_gate_inp_shexp · x). The
converter stores every norm but ssm_norm with HF's +1 applied."""
from __future__ import annotations

import dataclasses
from typing import Any

from moerun.gguf.reader import GGUFError, GGUFFile
from moerun.models.blocks import Step, delta_net, feed_forward, gated_attention, routed_and_shared_experts
from moerun.models.layer_weights import LayerWeights
from moerun.models.spec import ArchRule, DeltaNetShape, ModelSpec

RULE = ArchRule(family="qwen35moe", gguf_arch="qwen35moe", rope_style="neox", renormalize_topk=True)


def read_spec(gguf: GGUFFile, spec: ModelSpec) -> ModelSpec:
    """Which layers are DeltaNet and their shape (`ssm.*`); the rope sections checked."""
    recurrent = _recurrent_layers(gguf, spec.n_layers)
    _check_rope_sections(gguf, spec.rotary_dims)
    if not any(recurrent):
        return spec
    return dataclasses.replace(spec, recurrent_layers=recurrent, delta_net=_delta_net_shape(gguf))


def layer(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    x = delta_net(step, i, w, x) if step.spec.is_recurrent(i) else gated_attention(step, i, w, x)
    return feed_forward(step, i, w, x, routed_and_shared_experts)


def _recurrent_layers(gguf: GGUFFile, n_layers: int) -> tuple[bool, ...]:
    """Which layers are gated DeltaNet rather than attention: as listed in
    `attention.recurrent_layers`, else all but every `full_attention_interval`-th."""
    listed = gguf.get("qwen35moe.attention.recurrent_layers")
    if listed is not None:
        if len(listed) < n_layers:
            raise GGUFError(gguf.path, f"'qwen35moe.attention.recurrent_layers' has {len(listed)} entries for "
                            f"{n_layers} layers")
        return tuple(bool(v) for v in listed[:n_layers])
    interval = gguf.get("qwen35moe.full_attention_interval")
    if interval is None:
        return (False,) * n_layers
    if int(interval) < 1:
        raise GGUFError(gguf.path, f"'qwen35moe.full_attention_interval' is {interval}; it must be at least 1")
    return tuple((i + 1) % int(interval) != 0 for i in range(n_layers))


def _delta_net_shape(gguf: GGUFFile) -> DeltaNetShape:
    def key(name: str) -> int:
        value = gguf.get(f"qwen35moe.ssm.{name}")
        if value is None:
            raise GGUFError(gguf.path, f"missing metadata key 'qwen35moe.ssm.{name}' (the linear attention layers' "
                            f"shape)")
        return int(value)

    key_heads, value_heads = key("group_count"), key("time_step_rank")
    if key_heads < 1 or value_heads % key_heads:
        raise GGUFError(gguf.path, f"'qwen35moe.ssm.time_step_rank' ({value_heads} value heads) must be a multiple "
                        f"of 'qwen35moe.ssm.group_count' ({key_heads} key heads)")
    inner = key("inner_size")
    if inner % value_heads:
        raise GGUFError(gguf.path, f"'qwen35moe.ssm.inner_size' ({inner}) is not a multiple of {value_heads} value "
                        f"heads")
    return DeltaNetShape(key_heads=key_heads, value_heads=value_heads, key_dim=key("state_size"),
                         value_dim=inner // value_heads, conv_kernel=key("conv_kernel"))


def _check_rope_sections(gguf: GGUFFile, rope_dims: int) -> None:
    """The rope is multi-section (time, height, width, extra); for text, whose positions are
    equal on the first three and 0 on the fourth, it is plain NEOX rope only if every rotated
    pair takes one of the first three sections (as in llama.cpp's sector rule)."""
    sections = [int(v) for v in gguf.get("qwen35moe.rope.dimension_sections", [11, 11, 10, 0])]
    time, height, width = (sections + [0, 0, 0])[:3]
    total = sum(sections)
    for pair in range(rope_dims // 2):
        sector = pair % total if total else pair
        if not ((sector % 3 == 0 and sector < 3 * time) or (sector % 3 == 1 and sector < 3 * height)
                or (sector % 3 == 2 and sector < 3 * width)):
            raise GGUFError(gguf.path, f"'qwen35moe.rope.dimension_sections' {sections} leave rotated pair {pair} "
                            f"to the fourth section, which text positions do not use; moerun runs text only")
