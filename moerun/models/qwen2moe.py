"""Qwen2-MoE: q/k/v biases, NEOX rope, top-K weights not renormalised, and a shared
expert scaled by sigmoid(ffn_gate_inp_shexp · x)."""
from moerun.models.spec import ArchRule

RULE = ArchRule(
    family="qwen2moe", gguf_arch="qwen2moe", rope_style="neox",
    renormalize_topk=False, gated_shared_expert=True,
)
