"""A model's weights in the backend's form (each layer's as moerun.models.layer_weights
describes them), loaded from the GGUF file. The routed experts are the backend's Experts:
every expert, or the ones the placement keeps on the parent.

Attributes are named after the GGUF tensors (blk.N.<name>.weight).
Shape legend: H hidden, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moerun.backends.protocol import Backend, Experts
from moerun.gguf.reader import GGUFFile
from moerun.models.layer_weights import DeltaNetWeights, FFNWeights, LayerWeights, Matrix, Vector
from moerun.models.spec import ModelSpec


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
