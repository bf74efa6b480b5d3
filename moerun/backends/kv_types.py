"""The element types a KV cache keeps, by llama.cpp's names (`--cache-type-k/-v`, `-ctk/-ctv`):
f32, f16, bf16 and the 32-value blocks q8_0, q4_0, q4_1, q5_0, q5_1, each rounded as ggml
rounds it. The CPU parent keeps any of them (its kernels quantize the rows they append and
dequantize the rows they read); a GPU parent keeps f16 or f32.

A cache's rows as host arrays: float32 [S, NKV, D] for f32, else the stored bytes uint8 [S, NKV,
row bytes]. `encode` and `decode` are the numpy statement of what the CPU kernels do (gguf-py's
quantizers, which follow ggml's reference ones).

Shape legend: S positions, NKV kv heads, D a head's dims.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from moerun.errors import UsageError

KV_TYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16, "bf16": GGMLQuantizationType.BF16,
            "q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
            "q5_0": GGMLQuantizationType.Q5_0, "q5_1": GGMLQuantizationType.Q5_1}
GPU_KV_TYPES = ("f16", "f32")     # what a GPU parent's kernels read and write


@dataclass(frozen=True)
class KVTypes:
    key: str = "f32"
    value: str = "f32"

    def __post_init__(self) -> None:
        for flag, name in (("--cache-type-k", self.key), ("--cache-type-v", self.value)):
            if name not in KV_TYPES:
                raise UsageError(f"{flag} {name!r}: expected one of {', '.join(KV_TYPES)}")

    @property
    def label(self) -> str:
        """'q8_0' where keys and values share a type, else 'q8_0/f16' (keys/values)."""
        return self.key if self.key == self.value else f"{self.key}/{self.value}"

    def token_bytes(self, key_values: int, value_values: int) -> int:
        """Bytes of one position's keys and values over `key_values` and `value_values` elements
        (whole blocks: head dims are multiples of 32)."""
        return row_bytes(self.key, key_values) + row_bytes(self.value, value_values)

    def check_dims(self, head_dim_k: int, head_dim_v: int) -> None:
        """A block type needs whole blocks per head row; UsageError naming the flag otherwise."""
        for flag, name, dims in (("--cache-type-k", self.key, head_dim_k), ("--cache-type-v", self.value, head_dim_v)):
            block = GGML_QUANT_SIZES[KV_TYPES[name]][0]
            if dims % block:
                raise UsageError(f"{flag} {name}: heads of {dims} dims are not whole blocks of {block}; "
                                 f"use f16 or f32")


def check_gpu_kv_types(types: KVTypes) -> None:
    """A GPU parent's kernels keep keys and values in one type, f16 or f32; UsageError otherwise."""
    if types.key != types.value or types.key not in GPU_KV_TYPES:
        raise UsageError(f"KV cache types {types.key} (keys) and {types.value} (values): a GPU parent keeps both "
                         f"in one of {', '.join(GPU_KV_TYPES)} (quantized caches: --device cpu)")


def default_kv_types(device: str) -> KVTypes:
    """What a parent on `device` keeps unless told: f32 on the CPU (the CPU tests' precision), f16 on a GPU."""
    name = "f32" if device == "cpu" else "f16"
    return KVTypes(name, name)


def row_bytes(name: str, n: int) -> int:
    """Bytes of n values of KV type `name` (n a multiple of its block)."""
    block, nbytes = GGML_QUANT_SIZES[KV_TYPES[name]]
    return n // block * nbytes


def empty_rows(name: str, shape: tuple[int, int, int]) -> np.ndarray:
    """Room for [S, NKV, D] values of type `name`, as the cache holds them."""
    positions, heads, dims = shape
    if name == "f32":
        return np.empty(shape, np.float32)
    return np.empty((positions, heads, row_bytes(name, dims)), np.uint8)


def encode(name: str, x: np.ndarray) -> np.ndarray:
    """float32 [..., D] -> the cache's form of it (empty_rows)."""
    x = np.asarray(x, np.float32)
    if name == "f32":
        return x
    return quantize(x, KV_TYPES[name]).view(np.uint8)


def decode(name: str, rows: np.ndarray) -> np.ndarray:
    """The cache's form -> float32 [..., D]."""
    if name == "f32":
        return rows
    return dequantize(rows.view(np.uint8), KV_TYPES[name])
