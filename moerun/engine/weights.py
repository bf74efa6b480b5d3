"""Non-expert weights of every layer, dequantized to float32 at load.

Attributes are named after the GGUF tensors (blk.N.<name>.weight).
Shape legend: H hidden, NH/NKV heads, D head dim, E experts, F FFN widths.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec

Matrix = np.ndarray
FFNWeights = tuple[Matrix, Matrix, Matrix]  # gate [F, H], up [F, H], down [H, F]


@dataclass
class LayerWeights:
    attn_norm: np.ndarray                 # [H]
    attn_q: Matrix                        # [NH*D, H]
    attn_k: Matrix                        # [NKV*D, H]
    attn_v: Matrix                        # [NKV*Dv, H]
    attn_output: Matrix                   # [H, NH*Dv]
    attn_q_bias: np.ndarray | None        # [NH*D]      (qwen2moe)
    attn_k_bias: np.ndarray | None
    attn_v_bias: np.ndarray | None
    attn_q_norm: np.ndarray | None        # [D] per head (qwen3moe) or [NH*D] whole row (olmoe)
    attn_k_norm: np.ndarray | None
    ffn_norm: np.ndarray                  # [H]
    ffn_gate_inp: Matrix | None           # router [E, H]; None on dense layers
    ffn_dense: FFNWeights | None          # dense FFN layers
    ffn_shexp: FFNWeights | None          # shared expert (qwen2moe)
    ffn_gate_inp_shexp: np.ndarray | None  # [H] shared-expert gate


def load_layer(gguf: GGUFFile, spec: ModelSpec, i: int) -> LayerWeights:
    def need(name: str) -> np.ndarray:
        return gguf.dequantize(f"blk.{i}.{name}")

    def maybe(name: str) -> np.ndarray | None:
        return need(name) if gguf.has_tensor(f"blk.{i}.{name}") else None

    def ffn(suffix: str) -> FFNWeights:
        return need(f"ffn_gate{suffix}.weight"), need(f"ffn_up{suffix}.weight"), need(f"ffn_down{suffix}.weight")

    is_moe = spec.moe_layers[i]
    shared_gate = maybe("ffn_gate_inp_shexp.weight")
    return LayerWeights(
        attn_norm=need("attn_norm.weight"),
        attn_q=need("attn_q.weight"),
        attn_k=need("attn_k.weight"),
        attn_v=need("attn_v.weight"),
        attn_output=need("attn_output.weight"),
        attn_q_bias=maybe("attn_q.bias"),
        attn_k_bias=maybe("attn_k.bias"),
        attn_v_bias=maybe("attn_v.bias"),
        attn_q_norm=maybe("attn_q_norm.weight"),
        attn_k_norm=maybe("attn_k_norm.weight"),
        ffn_norm=need("ffn_norm.weight"),
        ffn_gate_inp=need("ffn_gate_inp.weight") if is_moe else None,
        ffn_dense=None if is_moe else ffn(""),
        ffn_shexp=ffn("_shexp") if is_moe and gguf.has_tensor(f"blk.{i}.ffn_down_shexp.weight") else None,
        ffn_gate_inp_shexp=None if shared_gate is None else shared_gate.reshape(-1),
    )
