"""Weights on the GPU in their stored form, uploaded straight from the GGUF mapping
through pinned staging buffers; or kept in page-locked host memory that the GPU's kernels read
directly (mapped, one address for both), for a table of which a step reads a few rows: the
token embedding, as llama.cpp keeps it on the host.

Types the kernels read directly stay as they are; any other type is dequantized
at load to f16 (said once in the log). Shape legend: N rows, K columns (elements
per row), E experts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from moerun.backends.gpu.constants import UNIT
from moerun.errors import UsageError
from moerun.gguf.quants import row_nbytes
from moerun.gguf.reader import GGUFFile

T = GGMLQuantizationType
KERNEL_TYPES = {T.F32: "f32", T.F16: "f16", T.BF16: "bf16", T.Q8_0: "q8_0", T.Q4_0: "q4_0", T.Q4_1: "q4_1",
                T.Q5_0: "q5_0", T.Q5_1: "q5_1", T.Q4_K: "q4_k", T.Q5_K: "q5_k", T.Q6_K: "q6_k"}
STAGING_BYTES = 64 << 20        # each of the two pinned buffers

logger = logging.getLogger(__name__)


@dataclass
class DeviceMatrix:
    """A weight matrix [N, K] (or a stack of E expert matrices [E, N, K]) in a stored type."""
    data: Any                   # device uint8 [E * N * row_bytes]
    kind: str                   # kernel suffix: f32, q4_k, ...
    rows: int                   # N
    cols: int                   # K
    experts: int = 1            # E

    @property
    def row_bytes(self) -> int:
        return self.data.size // (self.experts * self.rows)

    @property
    def expert_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols


def mapped_pinned(cupy, nbytes: int) -> tuple[Any, np.ndarray]:
    """Page-locked host memory the GPU's kernels can address: the allocation and a uint8 view of it."""
    runtime = cupy.cuda.runtime
    pinned = cupy.cuda.PinnedMemory(nbytes, runtime.hostAllocMapped | runtime.hostAllocPortable)
    return pinned, np.frombuffer(cupy.cuda.PinnedMemoryPointer(pinned, 0), np.uint8, count=nbytes)


def device_view(cupy, pinned: Any, nbytes: int, device_index: int) -> Any:
    """A device uint8 array over `nbytes` of mapped page-locked memory (one address for both)."""
    memory = cupy.cuda.UnownedMemory(pinned.ptr, nbytes, pinned, device_index)
    return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))


def stored_tensor(gguf: GGUFFile, name: str, experts: list[int] | None,
                  converted: set[str]) -> tuple[np.ndarray, str, int, int, int]:
    """The tensor's bytes in a type the kernels read (uint8 [E', N, row bytes]), that type,
    N, K and E' (the experts taken: all, or `experts` in that order). A type the kernels do not
    read is dequantized to f16 and its name added to `converted`."""
    info = gguf.tensor(name)
    shape = (1, *info.shape) if len(info.shape) == 1 else info.shape
    n_experts, rows, cols = (1, *shape) if len(shape) == 2 else shape
    if cols % UNIT:
        raise UsageError(f"tensor '{name}' has rows of {cols} weights; the GPU kernels need a multiple of {UNIT}")
    kind = KERNEL_TYPES.get(info.ggml_type)
    if kind is None:
        converted.add(info.ggml_type.name)
        kind = "f16"
        if experts is None:
            values = gguf.dequantize(name).reshape(n_experts, rows, cols)
        else:                                                              # only those experts' pages
            values = np.stack([gguf.dequantize_expert(name, e) for e in experts])
        stored = values.astype(np.float16).view(np.uint8)
    else:
        assert info.nbytes == n_experts * rows * row_nbytes(info.ggml_type, cols)
        stored = gguf.raw(name).reshape(n_experts, rows, -1).view(np.uint8)
        if experts is not None:
            stored = stored[np.asarray(experts)]                           # copies those experts only
    return stored, kind, rows, cols, n_experts if experts is None else len(experts)


class Uploader:
    """Copies bytes host -> device through two pinned buffers used in turn, so the
    CPU fills one while the GPU reads the other."""

    def __init__(self, cupy, gguf: GGUFFile, progress):
        self.cupy = cupy
        self.gguf = gguf
        self.progress = progress
        self._buffers = [cupy.cuda.alloc_pinned_memory(STAGING_BYTES) for _ in range(2)]
        self._events: list[Any] = [None, None]
        self._turn = 0
        self.converted: set[str] = set()

    def matrix(self, name: str, experts: list[int] | None = None) -> DeviceMatrix:
        """The tensor as a DeviceMatrix: 1-D tensors become one row; 3-D ones an expert
        stack, of every expert or of `experts` only, in that order."""
        stored, kind, rows, cols, n_experts = stored_tensor(self.gguf, name, experts, self.converted)
        return DeviceMatrix(self.bytes(stored.reshape(-1)), kind, rows, cols, n_experts)

    def host_matrix(self, name: str, device_index: int) -> DeviceMatrix:
        """A 2-D tensor as a DeviceMatrix whose bytes stay in mapped page-locked host memory:
        the kernels read its rows across the bus, and it takes no device memory."""
        cupy = self.cupy
        stored, kind, rows, cols, _ = stored_tensor(self.gguf, name, None, self.converted)
        stored = np.ascontiguousarray(stored.reshape(-1))
        pinned, host = mapped_pinned(cupy, stored.size)
        host[:] = stored
        self.progress(stored.size)
        return DeviceMatrix(device_view(cupy, pinned, stored.size, device_index), kind, rows, cols)

    def bytes(self, source: np.ndarray) -> Any:
        """A device copy of the uint8 array `source`."""
        cupy = self.cupy
        out = cupy.empty(source.size, dtype=cupy.uint8)
        for start in range(0, source.size, STAGING_BYTES):
            chunk = source[start:start + STAGING_BYTES]
            turn = self._turn
            if self._events[turn] is not None:
                self._events[turn].synchronize()             # the GPU is done with this buffer
            staging = np.frombuffer(self._buffers[turn], dtype=np.uint8, count=chunk.size)
            staging[:] = chunk
            out[start:start + chunk.size].data.copy_from_host_async(staging.ctypes.data, chunk.size)
            self._events[turn] = cupy.cuda.get_current_stream().record()
            self._turn = 1 - turn
            self.progress(chunk.size)
        return out

    def finish(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        if self.converted:
            logger.info(f"{', '.join(sorted(self.converted))} weights were converted to F16 at load (the GPU "
                        "kernels read F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K)")
