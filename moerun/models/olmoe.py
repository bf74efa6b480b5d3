"""olmoe (OLMoE-1B-7B): attention whose q/k RMSNorm spans the whole projection, then NEOX rope;
routed experts whose top-K weights are not renormalised."""
from __future__ import annotations

from typing import Any

from moerun.models.blocks import Step, feed_forward, routed_experts, whole_projection_qk_norm_attention
from moerun.models.layer_weights import LayerWeights
from moerun.models.spec import ArchRule, common_keys_only

RULE = ArchRule(family="olmoe", gguf_arch="olmoe", rope_style="neox", renormalize_topk=False)
read_spec = common_keys_only


def layer(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    x = whole_projection_qk_norm_attention(step, i, w, x)
    return feed_forward(step, i, w, x, routed_experts)
