"""GGML tensor types: byte sizes, zero-copy numpy views, dequantization to float32, and
row lookups in a 2-D tensor (an embedding) without dequantizing the rest."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from moerun.errors import UsageError

T = GGMLQuantizationType

# Types stored one element at a time, viewed with these dtypes. BF16 has no numpy
# dtype, so its raw view is the bit pattern as uint16.
ELEMENT_DTYPES: dict[GGMLQuantizationType, np.dtype] = {
    T.F32: np.dtype("<f4"),
    T.F16: np.dtype("<f2"),
    T.BF16: np.dtype("<u2"),
    T.F64: np.dtype("<f8"),
    T.I8: np.dtype("i1"),
    T.I16: np.dtype("<i2"),
    T.I32: np.dtype("<i4"),
    T.I64: np.dtype("<i8"),
}


def row_nbytes(ggml_type: GGMLQuantizationType, n_elements: int) -> int:
    """Bytes of a row of `n_elements`; ValueError unless the row is a whole number of blocks."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if n_elements % block_size:
        raise UsageError(
            f"rows of {n_elements} elements are not a multiple of the "
            f"{ggml_type.name} block size {block_size}"
        )
    return n_elements // block_size * type_size


def tensor_nbytes(ggml_type: GGMLQuantizationType, shape: Sequence[int]) -> int:
    """Bytes of a tensor of `shape` (numpy order, rows along the last axis)."""
    return prod(shape[:-1]) * row_nbytes(ggml_type, shape[-1])


def raw_view(data: np.ndarray, ggml_type: GGMLQuantizationType, shape: Sequence[int]) -> np.ndarray:
    """View the tensor bytes `data` (uint8, 1-D) without copying.

    Element types get their dtype and `shape`; block-quantized types stay uint8 of
    shape (*shape[:-1], bytes_per_row).
    """
    dtype = ELEMENT_DTYPES.get(ggml_type)
    if dtype is not None:
        return data.view(dtype).reshape(shape)
    return data.reshape(*shape[:-1], row_nbytes(ggml_type, shape[-1]))


def dequantize(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Float32 copy of a raw view; NotImplementedError for types gguf.quants cannot decode."""
    if ggml_type == T.BF16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if ggml_type in ELEMENT_DTYPES:
        return raw.astype(np.float32)
    if raw.size == 0:
        return np.zeros(gguf_quants.quant_shape_from_byte_shape(raw.shape, ggml_type), np.float32)
    return gguf_quants.dequantize(raw, ggml_type)


def row_ids(rows: Sequence[int] | np.ndarray, n_rows: int, name: str) -> np.ndarray:
    """Row ids [n] of tensor `name` as int64, each in [0, n_rows), else an IndexError naming it."""
    ids = np.asarray(rows, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
        raise IndexError(f"row ids of tensor '{name}' must be in [0, {n_rows})")
    return ids


@dataclass(frozen=True)
class RowTable:
    """A 2-D tensor [N, K] as stored, whose rows are dequantized when looked up."""
    raw: np.ndarray                       # raw_view of the tensor: [N, K] or [N, row bytes]
    ggml_type: GGMLQuantizationType
    name: str

    def lookup(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Float32 rows [len(rows), K]."""
        return dequantize(self.raw[row_ids(rows, self.raw.shape[0], self.name)], self.ggml_type)
