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
class LayerWeights:
    """The attention projections come either as attn_q/k/v, or fused as attn_qkv (llama.cpp's
    converter with --fuse-qkv): the q, k and v rows stacked in that order; the others None."""
    attn_norm: Vector                     # [H]
    attn_q: Matrix | None                 # [NH*D, H]
    attn_k: Matrix | None                 # [NKV*D, H]
    attn_v: Matrix | None                 # [NKV*Dv, H]
    attn_qkv: Matrix | None               # [NH*D + NKV*D + NKV*Dv, H]
    attn_output: Matrix                   # [H, NH*Dv]
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


@dataclass
class ModelWeights:
    layers: list[LayerWeights]
    experts: Experts                      # the routed experts this process computes
    token_embd: Any                       # [V, H], rows looked up by backend.embed
    output_norm: Vector                   # [H]
    output: Matrix                        # [V, H], the LM head (token_embd again when tied)


def load_weights(gguf: GGUFFile, spec: ModelSpec, backend: Backend, held: dict[int, list[int]] | None,
                 expert_cache_bytes: int) -> ModelWeights:
    """Every weight the parent computes with; `held`: its routed experts per layer when
    daemons hold the rest (None: all of them)."""
    backend.begin_loading(gguf)
    try:
        head = "output.weight" if gguf.has_tensor("output.weight") else "token_embd.weight"
        return ModelWeights(
            layers=[load_layer(gguf, spec, i, backend) for i in range(spec.n_layers)],
            experts=backend.load_experts(gguf, held, expert_cache_bytes),
            token_embd=backend.embedding(gguf, "token_embd.weight"),
            output_norm=backend.vector(gguf.dequantize("output_norm.weight")),
            output=backend.matrix(gguf, head),
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
    fused_qkv = gguf.has_tensor(f"blk.{i}.attn_qkv.weight")
    has_shared_gate = gguf.has_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight")
    return LayerWeights(
        attn_norm=vector("attn_norm.weight"),
        attn_q=None if fused_qkv else matrix("attn_q.weight"),
        attn_k=None if fused_qkv else matrix("attn_k.weight"),
        attn_v=None if fused_qkv else matrix("attn_v.weight"),
        attn_qkv=matrix("attn_qkv.weight") if fused_qkv else None,
        attn_output=matrix("attn_output.weight"),
        attn_q_bias=vector("attn_q.bias"),
        attn_k_bias=vector("attn_k.bias"),
        attn_v_bias=vector("attn_v.bias"),
        attn_qkv_bias=vector("attn_qkv.bias"),
        attn_q_norm=vector("attn_q_norm.weight"),
        attn_k_norm=vector("attn_k_norm.weight"),
        ffn_norm=vector("ffn_norm.weight"),
        ffn_gate_inp=matrix("ffn_gate_inp.weight") if is_moe else None,
        ffn_dense=None if is_moe else ffn(""),
        ffn_shexp=ffn("_shexp") if is_moe and gguf.has_tensor(f"blk.{i}.ffn_down_shexp.weight") else None,
        ffn_gate_inp_shexp=matrix("ffn_gate_inp_shexp.weight") if has_shared_gate else None,
    )
