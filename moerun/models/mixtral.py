"""Mixtral (8x7B, 8x22B): GGUF architecture `llama` with expert tensors. Plain attention with
normal-style (adjacent pair) rope, the converter having permuted the Q/K rows for it; routed
experts whose top-K weights are renormalised."""
from __future__ import annotations

from typing import Any

from moerun.gguf.reader import GGUFFile
from moerun.models.blocks import Step, attention, dense_ffn, routed_experts
from moerun.models.layer_weights import LayerWeights
from moerun.models.spec import ArchRule, ModelSpec

RULE = ArchRule(family="mixtral", gguf_arch="llama", rope_style="norm", renormalize_topk=True)


def read_spec(gguf: GGUFFile, spec: ModelSpec) -> ModelSpec:
    """Nothing beyond the common keys."""
    return spec


def layer(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    x = attention(step, i, w, x)
    return routed_experts(step, i, w, x) if step.spec.moe_layers[i] else dense_ffn(step, w, x)
