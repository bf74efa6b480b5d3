"""The kernel module (kernels/*.cu, one source tree for CUDA and HIP) compiled by
CuPy at first use, and launch helpers that size grids and thread groups."""
from __future__ import annotations

from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).parent / "kernels"
BLOCK = 256                     # threads per block of the row-parallel kernels
MAX_GEMV_TOKENS = 8             # MAX_TOKENS in common.cuh
INT_KINDS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")  # FOR_EACH_INT_TYPE, in its order
UNITS_PER_LANE = 2              # weight units each thread of an integer GEMV reads at least (loads in flight)
ROW_GROUP = 32                  # most threads sharing one output row (a power of two, <= 32)


class Kernels:
    def __init__(self, cupy):
        self.cupy = cupy
        source = (KERNEL_DIR / "moerun.cu").read_text()
        self.module = cupy.RawModule(code=source, options=("-std=c++17", f"-I{KERNEL_DIR}"))
        self._functions: dict[str, Any] = {}

    def __getitem__(self, name: str):
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = self.module.get_function(name)
        return function

    def rows(self, name: str, n_rows: int, units_per_row: int, grid_y: int, args: tuple,
             units_per_lane: int = 1) -> None:
        """Launch a row-parallel kernel: one group of threads per output row, the group as
        wide as the row has units (for at least `units_per_lane` each; a power of two, at
        most ROW_GROUP), as its last argument."""
        group = row_group(units_per_row, units_per_lane)
        rows_per_block = BLOCK // group
        grid = ((n_rows + rows_per_block - 1) // rows_per_block, grid_y)
        self[name](grid, (BLOCK,), (*args, self.cupy.int32(group)))

    def elementwise(self, name: str, n: int, args: tuple) -> None:
        """Launch a kernel of one thread per element."""
        self[name](((n + BLOCK - 1) // BLOCK,), (BLOCK,), args)


def row_group(units_per_row: int, units_per_lane: int = 1) -> int:
    """Threads sharing one row: a power of two, at most ROW_GROUP, each with at least
    `units_per_lane` of the row's units where the row has that many."""
    return min(ROW_GROUP, 1 << (max(units_per_row // units_per_lane, 1).bit_length() - 1))
