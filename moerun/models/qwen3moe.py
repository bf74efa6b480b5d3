"""Qwen3-MoE: per-head q/k RMSNorm, NEOX rope, top-K weights always renormalised."""
from moerun.models.spec import ArchRule

RULE = ArchRule(family="qwen3moe", gguf_arch="qwen3moe", rope_style="neox", renormalize_topk=True)
