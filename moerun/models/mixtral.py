"""Mixtral (8x7B, 8x22B): GGUF architecture `llama` with expert tensors. Plain attention with
normal-style (adjacent pair) rope, the converter having permuted the Q/K rows for it; routed
experts whose top-K weights are renormalised."""
from __future__ import annotations

from typing import Any

from moerun.models.blocks import Step, attention, feed_forward, routed_experts
from moerun.models.layer_weights import LayerWeights
from moerun.models.spec import ArchRule, common_keys_only

RULE = ArchRule(family="mixtral", gguf_arch="llama", rope_style="norm", renormalize_topk=True)
read_spec = common_keys_only


def layer(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    x = attention(step, i, w, x)
    return feed_forward(step, i, w, x, routed_experts)
