"""olmoe (OLMoE-1B-7B): attention whose q/k RMSNorm spans the whole projection, then NEOX rope;
routed experts whose top-K weights are not renormalised."""
from __future__ import annotations

from typing import Any

from moerun.gguf.reader import GGUFFile
from moerun.models.blocks import Step, dense_ffn, routed_experts, whole_projection_qk_norm_attention
from moerun.models.layer_weights import LayerWeights
from moerun.models.spec import ArchRule, ModelSpec

RULE = ArchRule(family="olmoe", gguf_arch="olmoe", rope_style="neox", renormalize_topk=False)


def read_spec(gguf: GGUFFile, spec: ModelSpec) -> ModelSpec:
    """Nothing beyond the common keys."""
    return spec


def layer(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    x = whole_projection_qk_norm_attention(step, i, w, x)
    return routed_experts(step, i, w, x) if step.spec.moe_layers[i] else dense_ffn(step, w, x)
