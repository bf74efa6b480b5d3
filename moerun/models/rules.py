"""What distinguishes each supported architecture in the forward pass, as llama.cpp runs it.

- qwen3moe: per-head q/k RMSNorm, NEOX rope, top-K weights always renormalised.
- qwen2moe: q/k/v biases, NEOX rope, top-K weights not renormalised, and a shared expert
  scaled by sigmoid(ffn_gate_inp_shexp · x).
- olmoe: q/k RMSNorm over the whole projection, NEOX rope, top-K weights not renormalised.
- Mixtral: GGUF architecture `llama` with expert tensors. The converter permutes Q/K rows so
  that normal-style (adjacent pair) rope applies; top-K weights renormalised.
- qwen35moe (Qwen3.5/3.6 MoE): gated DeltaNet layers, with full attention every few layers
  (`full_attention_interval`, or `attention.recurrent_layers`) whose attn_q gives each head's
  query and an output gate, per-head q/k RMSNorm, NEOX rope over the first
  `rope.dimension_count` dims of a head; top-K weights renormalised; a shared expert scaled
  by sigmoid(ffn_gate_inp_shexp · x). The converter stores every norm but ssm_norm with HF's
  +1 applied.
"""
from __future__ import annotations

from moerun.models.spec import ArchRule

QWEN3MOE = ArchRule(family="qwen3moe", gguf_arch="qwen3moe", rope_style="neox", renormalize_topk=True)
QWEN2MOE = ArchRule(family="qwen2moe", gguf_arch="qwen2moe", rope_style="neox", renormalize_topk=False,
                    gated_shared_expert=True)
OLMOE = ArchRule(family="olmoe", gguf_arch="olmoe", rope_style="neox", renormalize_topk=False)
MIXTRAL = ArchRule(family="mixtral", gguf_arch="llama", rope_style="norm", renormalize_topk=True)

QWEN35MOE = ArchRule(family="qwen35moe", gguf_arch="qwen35moe", rope_style="neox", renormalize_topk=True,
                     gated_shared_expert=True, gated_attention=True)

RULES: dict[str, ArchRule] = {rule.gguf_arch: rule for rule in (QWEN3MOE, QWEN2MOE, OLMOE, MIXTRAL, QWEN35MOE)}
SUPPORTED = "qwen3moe, qwen2moe, olmoe, Mixtral (llama with experts) and qwen35moe"
