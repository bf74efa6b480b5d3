"""A model's weights in the backend's form: float32 numpy arrays on the CPU, the stored
(quantized) bytes on a GPU; norms and biases always float32. The routed experts are the
backend's Experts: every expert, or the ones the placement keeps on the parent.

Attributes are named after the GGUF tensors (blk.N.<name>.weight).
Shape legend: H hidden, V vocab, NH/NKV heads, D head dim, E experts, F FFN widths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moerun.backends.protocol import Backend, Experts
from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec

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
    ffn_shexp: FFNWeights | None          # shared expert (qwen2moe)
    ffn_gate_inp_shexp: Matrix | None     # [1, H] shared-expert gate
    delta_net: DeltaNetWeights | None = None


@dataclass
class ModelWeights:
    layers: list[LayerWeights]            # layers first_layer.. of the model
    experts: Experts                      # the routed experts this process computes
    token_embd: Any | None                # [V, H], rows looked up by backend.embed; None on a layer shard
    output_norm: Vector | None            # [H]
    output: Matrix | None                 # [V, H], the LM head (token_embd again when tied)
    first_layer: int = 0


def load_weights(gguf: GGUFFile, spec: ModelSpec, backend: Backend, held: dict[int, list[int]] | None,
                 expert_cache_bytes: int, layers: range | None = None, ends: bool = True) -> ModelWeights:
    """Every weight this process computes with: the `layers` it runs (all by default), with the
    embedding and the head where `ends` (not on a layer shard); `held`: its routed experts per
    layer when daemons hold the rest (None: all of them)."""
    layers = range(spec.n_layers) if layers is None else layers
    if held is None and len(layers) < spec.n_layers:
        held = {layer: list(range(spec.n_experts)) for layer in layers if spec.moe_layers[layer]}
    if held is not None:
        held = {layer: ids for layer, ids in held.items() if layer in layers}
    backend.begin_loading(gguf)
    try:
        head = "output.weight" if gguf.has_tensor("output.weight") else "token_embd.weight"
        return ModelWeights(
            layers=[load_layer(gguf, spec, i, backend) for i in layers],
            experts=backend.load_experts(gguf, held, expert_cache_bytes),
            token_embd=backend.embedding(gguf, "token_embd.weight") if ends else None,
            output_norm=backend.vector(gguf.dequantize("output_norm.weight")) if ends else None,
            output=backend.matrix(gguf, head) if ends else None,
            first_layer=layers.start,
        )
    finally:
        backend.finish_loading()


def load_layer(gguf: GGUFFile, spec: ModelSpec, i: int, backend: Backend) -> LayerWeights:
    def matrix(name: str) -> Matrix:
        return backend.matrix(gguf, f"blk.{i}.{name}")

    def vector(name: str) -> Vector | None:
        full = f"blk.{i}.{name}"
        return backend.vector(gguf.dequantize(full)) if gguf.has_tensor(full) else None

    def ffn(suffix: str) -> FFNWeights:
        return (matrix(f"ffn_gate{suffix}.weight"), matrix(f"ffn_up{suffix}.weight"),
                matrix(f"ffn_down{suffix}.weight"))

    is_moe = spec.moe_layers[i]
    recurrent = spec.is_recurrent(i)
    fused_qkv = not recurrent and gguf.has_tensor(f"blk.{i}.attn_qkv.weight")
    has_shared_gate = gguf.has_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight")
    attention = not recurrent and not fused_qkv
    ffn_norm = "ffn_norm.weight" if gguf.has_tensor(f"blk.{i}.ffn_norm.weight") else "post_attention_norm.weight"
    return LayerWeights(
        attn_norm=vector("attn_norm.weight"),
        attn_q=matrix("attn_q.weight") if attention else None,
        attn_k=matrix("attn_k.weight") if attention else None,
        attn_v=matrix("attn_v.weight") if attention else None,
        attn_qkv=matrix("attn_qkv.weight") if fused_qkv else None,
        attn_output=None if recurrent else matrix("attn_output.weight"),
        attn_q_bias=vector("attn_q.bias"),
        attn_k_bias=vector("attn_k.bias"),
        attn_v_bias=vector("attn_v.bias"),
        attn_qkv_bias=None if recurrent else vector("attn_qkv.bias"),
        attn_q_norm=vector("attn_q_norm.weight"),
        attn_k_norm=vector("attn_k_norm.weight"),
        ffn_norm=vector(ffn_norm),
        ffn_gate_inp=matrix("ffn_gate_inp.weight") if is_moe else None,
        ffn_dense=None if is_moe else ffn(""),
        ffn_shexp=ffn("_shexp") if is_moe and gguf.has_tensor(f"blk.{i}.ffn_down_shexp.weight") else None,
        ffn_gate_inp_shexp=matrix("ffn_gate_inp_shexp.weight") if has_shared_gate else None,
        delta_net=load_delta_net(gguf, spec, i, backend) if recurrent else None,
    )


def load_delta_net(gguf: GGUFFile, spec: ModelSpec, i: int, backend: Backend) -> DeltaNetWeights:
    def matrix(name: str) -> Matrix:
        return backend.matrix(gguf, f"blk.{i}.{name}")

    def vector(name: str) -> Vector:
        return backend.vector(gguf.dequantize(f"blk.{i}.{name}"))

    shape = spec.delta_net
    conv = gguf.dequantize(f"blk.{i}.ssm_conv1d.weight").reshape(shape.channels, shape.conv_kernel)
    return DeltaNetWeights(attn_qkv=matrix("attn_qkv.weight"), attn_gate=matrix("attn_gate.weight"),
                           ssm_beta=matrix("ssm_beta.weight"), ssm_alpha=matrix("ssm_alpha.weight"),
                           ssm_a=vector("ssm_a"), ssm_dt=vector("ssm_dt.bias"), ssm_conv1d=backend.vector(conv),
                           ssm_norm=vector("ssm_norm.weight"), ssm_out=matrix("ssm_out.weight"))
