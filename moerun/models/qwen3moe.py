"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): attention with per-head q/k RMSNorm and NEOX rope;
routed experts whose top-K weights are always renormalised; dense FFN layers where the file
has them (leading_dense_block_count)."""
from __future__ import annotations

from typing import Any

from moerun.gguf.reader import GGUFFile
from moerun.models.blocks import Step, attention, dense_ffn, routed_experts
from moerun.models.layer_weights import LayerWeights
from moerun.models.spec import ArchRule, ModelSpec

RULE = ArchRule(family="qwen3moe", gguf_arch="qwen3moe", rope_style="neox", renormalize_topk=True)


def read_spec(gguf: GGUFFile, spec: ModelSpec) -> ModelSpec:
    """Nothing beyond the common keys."""
    return spec


def layer(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    x = attention(step, i, w, x)
    return routed_experts(step, i, w, x) if step.spec.moe_layers[i] else dense_ffn(step, w, x)
