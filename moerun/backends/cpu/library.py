"""The compiled CPU kernels through ctypes: the structs of kernels/moe_cpu.h, the functions
(moe_ffn and moe_ffn_padded, the grouped expert FFN, called by numpy_backend.QuantizedExperts; moe_matmul, the
products of a few matrices with one input, called by numpy_backend.StoredMatrix; the work of a
layer around its products, decode.c, called by numpy_backend.NumpyBackend; a CPU daemon's
arena served in a loop, serve.c, called by moerun.daemons.slot_server.SlotServer), the instruction
set they run with, and the threads they use by default.
load_kernels() builds or loads the library once per process; where it cannot, it says why once
and returns None (the caller then takes the numpy path).

Shape legend: T tokens, N a matrix's rows, n its columns, S cached positions, NH/NKV heads,
D/Dv head dims, E experts, K experts per token.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Sequence
from ctypes import POINTER, c_char, c_char_p, c_float, c_int, c_int64, c_void_p

import numpy as np

from moerun.backends.cpu.build import KernelsUnavailable, library_path
from moerun.errors import UsageError
from moerun.gguf.quants import T

logger = logging.getLogger(__name__)

STATUS = {1: "a tensor type without CPU kernels", 2: "matrix shapes that do not fit together",
          3: "an expert id out of range", 4: "a token row out of range"}
NO_MEMORY = 5
MAX_MATRICES = 8          # MOE_MAX_MATRICES: matrices one moe_matmul multiplies


class Matrix(ctypes.Structure):
    """struct moe_matrix: expert e's row r starts at data + e·expert_bytes + r·row_bytes."""
    _fields_ = [("data", c_void_p), ("type", c_int64), ("rows", c_int64), ("cols", c_int64),
                ("row_bytes", c_int64), ("expert_bytes", c_int64)]


class ExpertMatrices(ctypes.Structure):
    """struct moe_experts: one layer's gate and up [E, F, H] and down [E, H, F]."""
    _fields_ = [("gate", Matrix), ("up", Matrix), ("down", Matrix), ("n_experts", c_int64)]


class AttentionShape(ctypes.Structure):
    """struct moe_attention: one model's attention shapes and constants."""
    _fields_ = [("n_heads", c_int64), ("n_kv_heads", c_int64), ("head_dim_k", c_int64), ("head_dim_v", c_int64),
                ("rope_neox", c_int64), ("eps", c_float), ("scale", c_float), ("key_type", c_int64),
                ("value_type", c_int64)]


class SlotLayout(ctypes.Structure):
    """struct moe_slot_layout: byte offsets of an arena's words, headers and frames."""
    _fields_ = [(name, c_int64 if name != "arena" else c_void_p) for name in (
        "arena", "slots", "slot_bytes", "first_slot", "doorbell", "request_seq", "reply_seq", "parent_sleeping",
        "request_header", "reply_header", "data", "ids", "weights", "capacity", "hidden", "per_token", "version")]


class ServedLayer(ctypes.Structure):
    """struct moe_served_layer: a layer's experts and the global id of each local one."""
    _fields_ = [("experts", ExpertMatrices), ("expert_map", c_void_p), ("n_map", c_int64)]


class ServeCounts(ctypes.Structure):
    _fields_ = [("calls", c_int64), ("tokens", c_int64), ("compute_seconds", ctypes.c_double)]


class CpuKernels:
    def __init__(self, path):
        self.lib = lib = ctypes.CDLL(str(path))
        # arrays go as their data addresses: x, rows, experts, ids, weights, out (contiguous, of
        # the dtypes moe_cpu.h names)
        lib.moe_ffn.argtypes = [POINTER(ExpertMatrices), c_void_p, c_int64, c_void_p, c_void_p, c_void_p, c_int64,
                                c_void_p, c_int]
        lib.moe_ffn_padded.argtypes = [POINTER(ExpertMatrices), c_void_p, c_int64, c_void_p, c_void_p, c_int64,
                                       c_void_p, c_int64, c_void_p, c_int]
        lib.moe_matmul.argtypes = [POINTER(Matrix), c_int64, c_void_p, c_int64, c_void_p, c_int]
        lib.moe_rows.argtypes = [POINTER(Matrix), c_void_p, c_int64, c_void_p]
        lib.moe_rms_norm.argtypes = [c_void_p, c_int64, c_int64, c_int64, c_void_p, c_float, c_void_p]
        lib.moe_rms_norm.restype = None
        lib.moe_rope_append.argtypes = [POINTER(AttentionShape), c_int64, c_void_p, c_void_p, c_void_p, c_int64,
                                        c_int64, c_int64, *[c_void_p] * 7, c_int]
        lib.moe_attention.argtypes = [POINTER(AttentionShape), c_void_p, c_int64, c_int64, c_void_p, c_void_p,
                                      c_void_p, c_int]
        lib.moe_quantize_rows.argtypes = [c_int64, c_void_p, c_int64, c_int64, c_void_p]
        lib.moe_route.argtypes = [POINTER(Matrix), c_void_p, c_int64, c_void_p, c_float, c_int64, c_int, c_void_p,
                                  c_void_p, c_void_p, c_int]
        lib.moe_serve_slots.argtypes = [POINTER(SlotLayout), POINTER(ServedLayer), c_int64, c_void_p, c_void_p,
                                        ctypes.c_double, ctypes.c_double, c_int, POINTER(ServeCounts)]
        lib.moe_supports_type.argtypes = [c_int64]
        lib.moe_isa_name.argtypes = [c_int]
        lib.moe_isa_name.restype = c_char_p
        lib.moe_current_isa.restype = c_char_p
        lib.moe_unit_tokens.restype = c_int64
        lib.moe_use_isa.argtypes = [c_char_p]

    @property
    def isa(self) -> str:
        """The instruction set the kernels run with: amx, avx512, avx2, neon or scalar."""
        return self.lib.moe_current_isa().decode()

    @property
    def unit_tokens(self) -> int:
        """From how many tokens its matrix unit (amx) takes the products; 0 without one."""
        return self.lib.moe_unit_tokens()

    def isas(self) -> list[str]:
        """Those this machine can run, best first (the first is the default)."""
        return [self.lib.moe_isa_name(i).decode() for i in range(self.lib.moe_isa_count())]

    def use_isa(self, name: str) -> None:
        if not self.lib.moe_use_isa(name.encode()):
            raise UsageError(f"instruction set {name!r} is not usable here (usable: {', '.join(self.isas())})")

    def supports(self, ggml_type: int) -> bool:
        return bool(self.lib.moe_supports_type(int(ggml_type)))

    def matmul(self, matrices: Sequence[Matrix], x: np.ndarray, threads: int) -> np.ndarray:
        """x [T, n] · Wᵢᵀ for expert 0 of each matrix (at most MAX_MATRICES, all n wide): [T, ΣN],
        the products side by side."""
        x = np.ascontiguousarray(x, np.float32)
        if len(matrices) > MAX_MATRICES:
            raise ValueError(f"at most {MAX_MATRICES} matrices at once, not {len(matrices)}")
        y = np.empty((len(x), sum(m.rows for m in matrices)), np.float32)
        status = self.lib.moe_matmul((Matrix * len(matrices))(*matrices), len(matrices), address(x), len(x),
                                     address(y), threads)
        if status:
            raise kernel_error(status)
        return y

    def rows(self, matrix: Matrix, ids: np.ndarray) -> np.ndarray:
        """Rows ids [n] of the matrix (expert 0) as float32 [n, cols]."""
        ids = np.ascontiguousarray(ids, np.int64)
        out = np.empty((len(ids), matrix.cols), np.float32)
        status = self.lib.moe_rows(ctypes.byref(matrix), address(ids), len(ids), address(out))
        if status:
            raise kernel_error(status)
        return out

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """x [T, n] (rows of unit stride) -> x / sqrt(mean(x²) + eps) · weight [n]"""
        x = unit_columns(x)
        out = np.empty(x.shape, np.float32)
        self.lib.moe_rms_norm(address(x), x.strides[0] // 4, x.shape[0], x.shape[1], address(weight), eps,
                              address(out))
        return out

    def rope_append(self, shape: AttentionShape, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                    q_norm: np.ndarray | None, k_norm: np.ndarray | None, cos: np.ndarray, sin: np.ndarray,
                    k_rows: np.ndarray, v_rows: np.ndarray, threads: int) -> np.ndarray:
        """q [T, NH*D], k [T, NKV*D] normed per head (where q_norm, k_norm [D] are given) and rotated
        by cos, sin [T, D/2]; k written into k_rows [T, NKV, D], v [T, NKV*Dv] into v_rows (the
        cache's rows, in its types: kv_types.empty_rows). Returns the rotated q [T, NH, D]."""
        q, k, v = unit_columns(q), unit_columns(k), unit_columns(v)
        q_out = np.empty((len(q), shape.n_heads, shape.head_dim_k), np.float32)
        status = self.lib.moe_rope_append(shape, len(q), address(q), address(k), address(v),
                                          q.strides[0] // 4, k.strides[0] // 4, v.strides[0] // 4,
                                          None if q_norm is None else address(q_norm),
                                          None if k_norm is None else address(k_norm), address(cos),
                                          address(sin), address(k_rows), address(v_rows), address(q_out), threads)
        if status:
            raise kernel_error(status)
        return q_out

    def attention(self, shape: AttentionShape, q: np.ndarray, start: int, keys: np.ndarray, values: np.ndarray,
                  threads: int) -> np.ndarray:
        """q [T, NH, D] at positions start.. over keys [S, NKV, D] and values [S, NKV, Dv], the
        cache's rows in its types (S >= start + T) -> [T, NH*Dv]"""
        q = np.ascontiguousarray(q, np.float32)
        out = np.empty((len(q), shape.n_heads * shape.head_dim_v), np.float32)
        status = self.lib.moe_attention(shape, address(q), len(q), start, address(keys), address(values),
                                        address(out), threads)
        if status:
            raise kernel_error(status)
        return out

    def quantize_rows(self, ggml_type: int, x: np.ndarray, row_bytes: int) -> np.ndarray:
        """float32 rows [R, n] -> uint8 [R, row_bytes] of a KV cache type, as the cache appends them."""
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty((x.shape[0], row_bytes), np.uint8)
        status = self.lib.moe_quantize_rows(ggml_type, address(x), x.shape[0], x.shape[1], address(out))
        if status:
            raise kernel_error(status)
        return out

    def route(self, router: Matrix, x: np.ndarray, norm: np.ndarray, eps: float, k: int, renormalize: bool,
              threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """h = rms_norm(x [T, H], norm), h through the router [E, H], softmax, the K most probable
        (ties to the lower id) -> (h, ids [T, K], weights [T, K])"""
        x = np.ascontiguousarray(x, np.float32)
        h = np.empty_like(x)
        ids = np.empty((len(x), k), np.int64)
        weights = np.empty((len(x), k), np.float32)
        status = self.lib.moe_route(router, address(x), len(x), address(norm), eps, k, renormalize,
                                    address(h), address(ids), address(weights), threads)
        if status:
            raise kernel_error(status)
        return h, ids, weights


def address(array: np.ndarray) -> int:
    """Where the array's values start: through the buffer protocol where it is writable and
    contiguous (a fifth of the cost of array.ctypes.data, which is called for the others)."""
    try:
        return ctypes.addressof(c_char.from_buffer(array))
    except (TypeError, ValueError, BufferError):
        return array.ctypes.data


def unit_columns(x: np.ndarray) -> np.ndarray:
    """x [T, n] as float32 rows of unit stride (a column view of a wider array as it is)."""
    return x if x.dtype == np.float32 and x.strides[-1] == 4 else np.ascontiguousarray(x, np.float32)


def float_matrix(array: np.ndarray) -> Matrix:
    """The struct of a float32 matrix [N, n] (contiguous), for the kernels' F32 products."""
    rows, cols = array.shape
    return Matrix(array.ctypes.data, int(T.F32), rows, cols, 4 * cols, 4 * rows * cols)


def kernel_error(status: int) -> Exception:
    """The exception for a moe_status other than MOE_OK."""
    if status == NO_MEMORY:
        return MemoryError("the CPU kernels could not allocate their buffers")
    return ValueError(f"the CPU kernels were given {STATUS.get(status, f'something they refuse ({status})')}")


def default_threads() -> int:
    """The count where none is given (--threads, the config's `threads`, a daemon's share from
    rig/cores.py): $OMP_NUM_THREADS where set, else every CPU this process may run on."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return len(usable_cpus())


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask), or all of them where the OS does not say."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


@functools.cache
def load_kernels() -> CpuKernels | None:
    """The kernels, built at first use; None (with one notice) where they cannot be had."""
    try:
        kernels = CpuKernels(library_path())
    except (KernelsUnavailable, OSError) as err:
        logger.warning(f"CPU expert kernels unavailable: {err}. Experts on the CPU are dequantized to float32 "
                       f"and multiplied with numpy instead (slower, and 4 bytes of memory per weight).")
        return None
    logger.debug(f"CPU expert kernels: {kernels.isa} (usable here: {', '.join(kernels.isas())})")
    return kernels
