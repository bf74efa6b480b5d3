"""The kernel module (kernels/*.cu, one source tree for CUDA and HIP) compiled by
CuPy at first use, and launch helpers that size grids and thread groups."""
from __future__ import annotations

from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).parent / "kernels"
BLOCK = 256                     # threads per block of the row-parallel kernels
MAX_GEMV_TOKENS = 8             # MAX_TOKENS in common.cuh
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

    def rows(self, name: str, n_rows: int, units_per_row: int, grid_y: int, args: tuple) -> None:
        """Launch a row-parallel kernel: one group of threads per output row, the group
        as wide as the row has units (a power of two, at most ROW_GROUP), as its last argument."""
        group = min(ROW_GROUP, 1 << (max(units_per_row, 1).bit_length() - 1))
        rows_per_block = BLOCK // group
        grid = ((n_rows + rows_per_block - 1) // rows_per_block, grid_y)
        self[name](grid, (BLOCK,), (*args, self.cupy.int32(group)))

    def elementwise(self, name: str, n: int, args: tuple) -> None:
        """Launch a kernel of one thread per element."""
        self[name](((n + BLOCK - 1) // BLOCK,), (BLOCK,), args)
