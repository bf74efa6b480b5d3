"""Read a GGUF written by to_gguf back into a transformers model, dequantized.

A transformers forward pass of `dequantized_model(model, path)` sees exactly
the weights a GGUF engine sees, so it is the reference for quantized files.
"""
from __future__ import annotations

import copy

import gguf
import numpy as np
import torch

from .to_gguf import QWEN35_NAMES, arch_of, gguf_names, qwen35_transform, rope_permute_heads


def read_dequantized(gguf_path) -> dict[str, np.ndarray]:
    """Every tensor of the file as float32 in GGUF numpy order (ggml ne reversed)."""
    reader = gguf.GGUFReader(gguf_path)
    return {
        tensor.name: gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)  # a writable copy
        for tensor in reader.tensors
    }


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of to_gguf.permute_rope_rows: llama.cpp's adjacent pairs back to rotate-halves."""
    rows = weight.shape[0]
    per_head = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def hf_state_dict(model, gguf_path) -> dict[str, torch.Tensor]:
    """The GGUF's tensors under `model`'s parameter names and layouts."""
    tensors = read_dequantized(gguf_path)
    fused_gate_up = any(name.endswith("ffn_gate_up_exps.weight") for name in tensors)
    state: dict[str, torch.Tensor] = {}
    hybrid = arch_of(model) == "qwen35moe"
    for hf_name, param in model.state_dict().items():
        names = gguf_names(hf_name, fused_gate_up=fused_gate_up, names=QWEN35_NAMES if hybrid else None)
        parts = [tensors[name] for name in names]
        weight = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]  # 2 x (E, F, H) -> (E, 2F, H)
        if (n_heads := rope_permute_heads(model, hf_name)) is not None:
            weight = unpermute_rope_rows(weight, n_heads)
        if hybrid:
            weight = qwen35_transform(model.config, hf_name, weight, inverse=True)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(weight)).reshape(param.shape)
    return state


def dequantized_model(model, gguf_path):
    """A deep copy of `model` whose weights are the GGUF's, dequantized and back in HF layout."""
    clone = copy.deepcopy(model)
    clone.load_state_dict(hf_state_dict(model, gguf_path), strict=True)
    return clone.eval()
