"""The kernel module (kernels/*.cu, one source tree for CUDA and HIP) compiled by
CuPy at first use, and launch helpers that size grids and thread groups.

On CUDA GPUs of compute capability 9.0 and later, kernels go out as programmatic
dependent launches (the driver's cuLaunchKernelEx, through ctypes): the next kernel on
the stream is scheduled while the one before it finishes, and waits inside for its
writes (wait_for_previous_grid in common.cuh), which hides most of the gap between
the small kernels of a decode step.
"""
from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from moerun.backends.devices import GpuError, is_gpu_error
from moerun.backends.gpu.constants import defines
from moerun.errors import MoerunError

KERNEL_DIR = Path(__file__).parent / "kernels"
BLOCK = 256                     # threads per block of the row-parallel kernels
INT_KINDS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")  # FOR_EACH_INT_TYPE, in its order
UNITS_PER_LANE = 2              # weight units each thread of an integer GEMV reads at least (loads in flight)
ONE_TOKEN_UNITS_PER_LANE = 4    # ... of the one-token GEMVs (gemv_q8_one, gemv_q8_three_one: 4 units in flight)
ONE_TOKEN_BLOCK = 128           # threads per block of gemv_q8_one (the LM head: 5% faster than BLOCK)
ROW_GROUP = 32                  # most threads sharing one output row (a power of two, <= 32)
PROGRAMMATIC_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
STAGE_LIMIT = 48 * 1024         # most shared memory per block for staged weight rows (no opt-in needed)
FULL_OCCUPANCY_BYTES = 112      # staged bytes per thread that leave a multiprocessor all of its threads
                                # (Hopper: 228 KiB of shared memory over 2048 threads)
NULL = np.uint64(0)             # a null pointer argument


def pointer(array: Any | None) -> Any:
    """A kernel's pointer argument: the array, or NULL for None."""
    return NULL if array is None else array


class Kernels:
    def __init__(self, cupy):
        self.cupy = cupy
        self.module = cupy.RawModule(code=kernel_source(), options=("-std=c++17", f"-I{KERNEL_DIR}", *defines()))
        self._functions: dict[str, Any] = {}
        self._waves: dict[str, int] = {}
        self._dependent = DependentLauncher.for_device(cupy)

    def __getitem__(self, name: str):
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = self.module.get_function(name)
        return function

    def launch(self, name: str, grid: tuple, block: tuple, args: tuple, shared_bytes: int = 0) -> None:
        """Every kernel goes through here; a failure, the launch's own or one the device reports
        then, is a GpuError naming the kernel."""
        try:
            if self._dependent is None:
                self[name](grid, block, args, shared_mem=shared_bytes)
            else:
                self._dependent.launch(self[name].kernel.ptr, grid, block, args, shared_bytes,
                                       self.cupy.cuda.get_current_stream().ptr)
        except Exception as err:
            if isinstance(err, LaunchFailed) or is_gpu_error(err):
                raise GpuError(f"kernel {name} (grid {tuple(grid)}, block {tuple(block)})", err) from None
            raise

    def rows(self, name: str, n_rows: int, units_per_row: int, grid_y: int, args: tuple,
             units_per_lane: int = 1, staged_bytes: int | None = None, shared_after: int = 0,
             block: int = BLOCK) -> None:
        """Launch a row-parallel kernel: one group of threads per output row, the group as
        wide as the row has units (for at least `units_per_lane` each; a power of two, at
        most ROW_GROUP; see fitting_group), as its last argument. A kernel that stages its
        weight rows in shared memory (staging.cuh), a slot per group, is given `staged_bytes`,
        the bytes of one group's rows: the slots' stride goes before the group; `shared_after`
        more bytes of shared memory follow the slots (for the kernel's own use). Blocks have
        `block` threads."""
        group = fitting_group(row_group(units_per_row, units_per_lane), n_rows, grid_y, self.wave(name, block), block)
        grid = (blocks_of_rows(n_rows, group, block), grid_y)
        if staged_bytes is None:
            self.launch(name, grid, (block,), (*args, self.cupy.int32(group)))
            return
        stride = stage_stride(staged_bytes, block // group, STAGE_LIMIT - shared_after)
        self.launch(name, grid, (block,), (*args, self.cupy.int32(stride), self.cupy.int32(group)),
                    stride * (block // group) + shared_after)

    def wave(self, name: str, block: int = BLOCK) -> int:
        """Blocks of `block` threads of kernel `name` the whole GPU holds at once."""
        wave = self._waves.get((name, block))
        if wave is None:
            cuda = self.cupy.cuda
            per_multiprocessor = cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(self[name].kernel.ptr, block, 0)
            wave = self._waves[(name, block)] = per_multiprocessor * cuda.Device().attributes["MultiProcessorCount"]
        return wave

    def elementwise(self, name: str, n: int, args: tuple) -> None:
        """Launch a kernel of one thread per element."""
        self.launch(name, ((n + BLOCK - 1) // BLOCK,), (BLOCK,), args)


def kernel_source(folder: Path = KERNEL_DIR) -> str:
    """moerun.cu under a digest of every file of the kernel tree: CuPy keys its cache of compiled
    modules by the code it is given, not by the files that code includes, so without the digest an
    upgrade in place would run the kernels its headers had before."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.suffix in (".cu", ".cuh"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"// kernel tree {digest.hexdigest()}\n" + (folder / "moerun.cu").read_text()


def row_group(units_per_row: int, units_per_lane: int = 1) -> int:
    """Threads sharing one row: a power of two, at most ROW_GROUP, each with at least
    `units_per_lane` of the row's units where the row has that many."""
    return min(ROW_GROUP, 1 << (max(units_per_row // units_per_lane, 1).bit_length() - 1))


def blocks_of_rows(n_rows: int, group: int, block: int = BLOCK) -> int:
    return -(-n_rows // (block // group))


def stage_stride(slot_bytes: int, slots: int, limit: int = STAGE_LIMIT) -> int:
    """Bytes of each of a block's `slots` slots of staged weight rows (staging.cuh), for rows of
    `slot_bytes` at any alignment: room for their offset within 16 bytes, in whole 16-byte
    pieces, and 16 more so that consecutive slots start in other shared memory banks. 0 (no
    staging) where a block's slots would pass `limit` bytes."""
    stride = -(-(slot_bytes + 15) // 16) * 16 + 16
    return stride if stride * slots <= limit else 0


def fitting_group(group: int, n_rows: int, grid_y: int, wave: int, block: int = BLOCK) -> int:
    """`group`, or half of it where that brings a grid just over one wave of resident blocks
    (`wave`) into one: the blocks of a second, partial wave would add almost a whole kernel's
    latency (q/k/v of the 30B-A3B shape, 1.2 waves: 11.6 -> 9.1 us in one)."""
    if group > 1 and blocks_of_rows(n_rows, group, block) * grid_y > wave >= \
            blocks_of_rows(n_rows, group // 2, block) * grid_y:
        return group // 2
    return group


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(_LaunchAttribute)),
                ("n_attributes", ctypes.c_uint)]


_SCALARS = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64,
            np.float32: ctypes.c_float, np.float64: ctypes.c_double}


class LaunchFailed(MoerunError, RuntimeError):
    """cuLaunchKernelEx returned an error (its name and number)."""


class DependentLauncher:
    """Kernel launches with programmatic stream serialization allowed (cuLaunchKernelEx)."""

    def __init__(self, cupy, driver: ctypes.CDLL):
        self.cupy = cupy
        self._launch = driver.cuLaunchKernelEx
        self._launch.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self._error_name = driver.cuGetErrorName
        self._attribute = _LaunchAttribute(id=PROGRAMMATIC_SERIALIZATION, value=1)

    @classmethod
    def for_device(cls, cupy) -> DependentLauncher | None:
        """A launcher where the device has programmatic dependent launches (CUDA, 9.0+), else None."""
        runtime = cupy.cuda.runtime
        if runtime.is_hip or int(cupy.cuda.Device().compute_capability) < 90:
            return None
        try:
            return cls(cupy, ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError):
            return None

    def launch(self, function: int, grid: tuple, block: tuple, args: tuple, shared_bytes: int, stream: int) -> None:
        grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        values = [self._argument(a) for a in args]
        params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_bytes, stream,
                               ctypes.pointer(self._attribute), 1)
        status = self._launch(ctypes.byref(config), function, params, None)
        if status:
            name = ctypes.c_char_p()
            self._error_name(status, ctypes.byref(name))
            raise LaunchFailed(f"{(name.value or b'?').decode()} ({status})")

    def _argument(self, value: Any):
        if isinstance(value, self.cupy.ndarray):
            return ctypes.c_void_p(value.data.ptr)
        return _SCALARS[type(value)](value)
