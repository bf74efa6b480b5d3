"""qwen2moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): attention with q/k/v biases and NEOX rope;
routed experts whose top-K weights are not renormalised, beside a shared expert scaled by
sigmoid(ffn_gate_inp_shexp · x); dense FFN layers where the file has them."""
from __future__ import annotations

from typing import Any

from moerun.models.blocks import Step, attention, feed_forward, routed_and_shared_experts
from moerun.models.layer_weights import LayerWeights
from moerun.models.spec import ArchRule, common_keys_only

RULE = ArchRule(family="qwen2moe", gguf_arch="qwen2moe", rope_style="neox", renormalize_topk=False)
read_spec = common_keys_only


def layer(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    x = attention(step, i, w, x)
    return feed_forward(step, i, w, x, routed_and_shared_experts)
