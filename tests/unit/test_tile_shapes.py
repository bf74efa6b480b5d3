"""The GPU prefill's tile shape follows the experts' average load (moerun.backends.gpu.experts),
and every shape the Python side launches is one the kernel source defines."""
import re

import pytest

from moerun.backends.gpu.experts import TILE_SHAPES, tile_rows
from moerun.backends.gpu.library import KERNEL_DIR


@pytest.mark.parametrize("n_pairs, n_experts, rows", [
    (1024, 8, 128),        # Mixtral, 512 tokens, top-2 of 8: 128 pairs an expert
    (4096, 128, 32),       # Qwen3-30B-A3B, 512 tokens, top-8 of 128: 32
    (16384, 128, 128),     # the same at 2048 tokens: 128
    (4096, 64, 64),        # OLMoE, 512 tokens, top-8 of 64: 64
    (128, 8, 32),          # Mixtral, 64 tokens: 16 an expert
    (760, 8, 64),          # 95 an expert: short of three quarters of 128
    (768, 8, 128),         # 96: three quarters of 128
    (10, 1000, 32),        # fewer pairs than experts
])
def test_tile_rows_from_the_average_load(n_pairs, n_experts, rows):
    assert tile_rows(n_pairs, n_experts) == rows


def test_the_kernels_define_every_tile_shape():
    source = (KERNEL_DIR / "moe_mm.cu").read_text()
    shapes = {int(rows): (int(cols), int(warps)) for rows, cols, warps in
              re.findall(r"struct TileShape<(\d+)> \{ static constexpr int cols = (\d+), depth = \d+, warps = (\d+)",
                         source)}
    assert shapes == TILE_SHAPES
    defined = re.search(r"#define DEFINE_MOE_MM\(TYPE\) (.*)", source).group(1)
    rows = sorted(int(rows) for rows in re.findall(r"DEFINE_MOE_MM_ROWS\(TYPE, (\d+)\)", defined))
    assert rows == sorted(TILE_SHAPES)
