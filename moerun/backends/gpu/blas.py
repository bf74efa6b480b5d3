"""Batched matrix products with f32 accumulation and f32 output through the vendor
BLAS (cuBLAS, or hipBLAS on ROCm): f16 operands for the prefill weight products,
f32 ones for attention (multiplied in TF32 on the matrix units where cuBLAS offers it: the
precision of the f16 weight products; f32 throughout on ROCm), in strided batches through
CuPy's wrapper.

The BLAS is column-major: a row-major [M, N] result is the column-major N×M matrix,
so every product below is written for the transposed operands.
Shape legend: B batch, M rows of a, N rows of b, K shared width.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class Blas:
    def __init__(self, cupy):
        from cupy_backends.cuda.libs import cublas
        self.cupy = cupy
        self.cublas = cublas
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)
        runtime = cupy.cuda.runtime
        self._types = {np.dtype(np.float16): runtime.CUDA_R_16F, np.dtype(np.float32): runtime.CUDA_R_32F}
        self._compute = getattr(cublas, "CUBLAS_COMPUTE_32F", runtime.CUDA_R_32F)
        self._compute_tf32 = self._compute if runtime.is_hip else getattr(
            cublas, "CUBLAS_COMPUTE_32F_FAST_TF32", self._compute)

    def matmul(self, a: Any, b: Any, accumulate: Any | None = None, out: Any | None = None) -> Any:
        """out[i] = a[i] · b[i]ᵀ (+ accumulate[i]): a [B, M, K], b [B, N, K] of one dtype
        (f16 or f32, contiguous) -> f32 [B, M, N], written into `out` when given."""
        cupy = self.cupy
        batch, m, k = a.shape
        n = b.shape[1]
        if accumulate is not None:
            out = cupy.ascontiguousarray(accumulate, dtype=cupy.float32).reshape(batch, m, n).copy()
        elif out is None:
            out = cupy.empty((batch, m, n), cupy.float32)
        self.gemm(transpose_a=True, transpose_b=False, m=n, n=m, k=k,
                  a=b, lda=k, stride_a=n * k, b=a, ldb=k, stride_b=m * k,
                  c=out, ldc=n, stride_c=m * n, batch=batch, accumulate=accumulate is not None)
        return out

    def gemm(self, *, transpose_a: bool, transpose_b: bool, m: int, n: int, k: int, a: Any, lda: int, stride_a: int,
             b: Any, ldb: int, stride_b: int, c: Any, ldc: int, stride_c: int, batch: int,
             accumulate: bool = False, tf32: bool = False) -> None:
        """Column-major c[i] (m×n) = op(a[i]) · op(b[i]) (+ c[i]) for i < batch; a and b share a
        dtype, c is f32; strides and leading dimensions in elements. tf32: f32 operands rounded
        to TF32 on the matrix units (attention), else exact f32 products (the routers)."""
        cupy, cublas = self.cupy, self.cublas
        handle = cupy.cuda.device.get_cublas_handle()
        cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
        operand = self._types[a.dtype]
        cublas.gemmStridedBatchedEx(
            handle, cublas.CUBLAS_OP_T if transpose_a else cublas.CUBLAS_OP_N,
            cublas.CUBLAS_OP_T if transpose_b else cublas.CUBLAS_OP_N, m, n, k,
            self._one.ctypes.data, a.data.ptr, operand, lda, stride_a, b.data.ptr, operand, ldb, stride_b,
            (self._one if accumulate else self._zero).ctypes.data, c.data.ptr, self._types[c.dtype], ldc, stride_c,
            batch, self._compute_tf32 if tf32 else self._compute, cublas.CUBLAS_GEMM_DEFAULT)
