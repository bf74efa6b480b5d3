"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): attention with per-head q/k RMSNorm and NEOX rope;
routed experts whose top-K weights are always renormalised; dense FFN layers where the file
has them (leading_dense_block_count)."""
from __future__ import annotations

from typing import Any

from moerun.models.blocks import Step, attention, feed_forward, routed_experts
from moerun.models.layer_weights import LayerWeights
from moerun.models.spec import ArchRule, common_keys_only

RULE = ArchRule(family="qwen3moe", gguf_arch="qwen3moe", rope_style="neox", renormalize_topk=True)
read_spec = common_keys_only


def layer(step: Step, i: int, w: LayerWeights, x: Any) -> Any:
    x = attention(step, i, w, x)
    return feed_forward(step, i, w, x, routed_experts)
