"""Random matrices as GGUF stores them, of every type the CPU kernels read, and their values.

Quantized blocks are random bytes (every quant, scale and min bit pattern) with their f16
fields set to finite values that keep every weight within about ±0.1 (some of them f16
subnormals); float types are random normal values."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moerun.gguf.quants import dequantize

T = GGMLQuantizationType
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
BLOCK_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
KERNEL_TYPES = FLOAT_TYPES + BLOCK_TYPES
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
              T.Q5_K: (0, 2), T.Q6_K: (208,)}      # byte offsets of each block's f16 scales
LARGEST_LEVEL = {T.Q4_0: 8, T.Q4_1: 15, T.Q5_0: 16, T.Q5_1: 31, T.Q8_0: 128, T.Q4_K: 15 * 63, T.Q5_K: 31 * 63,
                 T.Q6_K: 32 * 128}                 # of the integers the f16 scales multiply
ELEMENT_DTYPES = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}


def row_bytes(ggml_type: T, cols: int) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return cols // block_size * type_size


def random_stored(ggml_type: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes]."""
    if ggml_type in FLOAT_TYPES:
        values = rng.normal(0, 0.1, (rows, cols)).astype(np.float32)
        if ggml_type == T.BF16:
            values = (values.view(np.uint32) >> 16).astype(np.uint16)
        return values.astype(ELEMENT_DTYPES[ggml_type]).view(np.uint8).reshape(rows, -1)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[ggml_type]:
        scales = rng.uniform(0.01, 0.1, len(blocks)) / LARGEST_LEVEL[ggml_type] * rng.choice([-1.0, 1.0], len(blocks))
        blocks[:, offset:offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def stored_values(raw: np.ndarray, ggml_type: T) -> np.ndarray:
    """The values of raw [rows, row bytes], float64 [rows, cols]."""
    view = raw.view(ELEMENT_DTYPES[ggml_type]) if ggml_type in FLOAT_TYPES else raw
    return dequantize(view, ggml_type).astype(np.float64)
