"""One layer's weights in the backend's form, as the architectures' blocks read them: float32
numpy arrays on the CPU, the stored (quantized) bytes on a GPU; norms and biases always float32.
Loaded by moerun.engine.weights.

Attributes are named after the GGUF tensors (blk.N.<name>.weight).
Shape legend: H hidden, NH/NKV heads, D head dim (Dv of values), F FFN widths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Matrix = Any      # the backend's weight matrix [N, K]
Vector = Any      # the backend's float32 vector
FFNWeights = tuple[Matrix, Matrix, Matrix]  # gate [F, H], up [F, H], down [H, F]


@dataclass
class DeltaNetWeights:
    """A gated DeltaNet layer (qwen35moe) in place of attention: HK/HV key/value heads of DK/DV,
    C = 2·HK·DK + HV·DV convolved channels (q, k, v), conv kernel W."""
    attn_qkv: Matrix                      # [C, H] the channels before the convolution
    attn_gate: Matrix                     # [HV*DV, H] z, the output gate
    ssm_beta: Matrix                      # [HV, H] the update's strength, through a sigmoid
    ssm_alpha: Matrix                     # [HV, H] the decay's rate, through softplus(· + ssm_dt)
    ssm_a: Vector                         # [HV] -exp(A_log): the decay's scale
    ssm_dt: Vector                        # [HV]
    ssm_conv1d: Vector                    # [C, W] float32
    ssm_norm: Vector                      # [DV] the gated RMSNorm of each head's output
    ssm_out: Matrix                       # [H, HV*DV]


@dataclass
class LayerWeights:
    """The attention projections come either as attn_q/k/v, or fused as attn_qkv (llama.cpp's
    converter with --fuse-qkv): the q, k and v rows stacked in that order; the others None.
    A gated-attention model's attn_q holds each head's query rows, then its gate's. A DeltaNet
    layer has `delta_net` and no attention projections."""
    attn_norm: Vector                     # [H]
    attn_q: Matrix | None                 # [NH*D, H] ([NH*2D, H] with the gates)
    attn_k: Matrix | None                 # [NKV*D, H]
    attn_v: Matrix | None                 # [NKV*Dv, H]
    attn_qkv: Matrix | None               # [NH*D + NKV*D + NKV*Dv, H]
    attn_output: Matrix | None            # [H, NH*Dv]
    attn_q_bias: Vector | None            # [NH*D]      (qwen2moe)
    attn_k_bias: Vector | None
    attn_v_bias: Vector | None
    attn_qkv_bias: Vector | None          # [NH*D + NKV*D + NKV*Dv] (qwen2moe, fused)
    attn_q_norm: Vector | None            # [D] per head (qwen3moe) or [NH*D] whole row (olmoe)
    attn_k_norm: Vector | None
    ffn_norm: Vector                      # [H]
    ffn_gate_inp: Matrix | None           # router [E, H]; None on dense layers
    ffn_dense: FFNWeights | None          # dense FFN layers
    ffn_shexp: FFNWeights | None          # shared expert (qwen2moe, qwen35moe)
    ffn_gate_inp_shexp: Matrix | None     # [1, H] shared-expert gate
    delta_net: DeltaNetWeights | None = None
