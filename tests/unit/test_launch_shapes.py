"""How a row-parallel kernel's threads are grouped (moerun/backends/gpu_kernels.py): pure
arithmetic, so it is checked here without a GPU."""
from __future__ import annotations

import pytest

from moerun.backends.gpu_kernels import (
    BLOCK,
    ROW_GROUP,
    blocks_of_rows,
    fitting_group,
    row_group,
    stage_stride,
    staged_bytes,
)


@pytest.mark.parametrize("units_per_row, units_per_lane, want", [
    (64, 2, 32), (128, 2, 32), (24, 2, 8), (1, 2, 1), (64, 4, 16), (7, 1, 4)])
def test_row_group_is_a_power_of_two_with_enough_units_per_lane(units_per_row, units_per_lane, want):
    assert row_group(units_per_row, units_per_lane) == want
    assert want <= ROW_GROUP


def test_a_grid_just_over_one_wave_takes_groups_half_as_wide():
    """q, k and v of the 30B-A3B shape: 5120 rows of 64 units; 4 blocks of 256 per
    multiprocessor on 132 of them hold 528 blocks."""
    wave = 4 * 132
    assert blocks_of_rows(5120, 32) == 640
    assert fitting_group(32, 5120, 1, wave) == 16
    assert blocks_of_rows(5120, 16) == 320 <= wave


@pytest.mark.parametrize("n_rows, grid_y, wave", [
    (2048, 1, 528),          # already one wave: unchanged
    (151936, 1, 528),        # many waves either way (an LM head): unchanged
    (5120, 3, 528),          # three tokens' worth: halving still leaves two waves
    (4224, 1, 528)])         # exactly one wave
def test_other_grids_keep_their_groups(n_rows, grid_y, wave):
    assert fitting_group(32, n_rows, grid_y, wave) == 32


def test_blocks_cover_every_row():
    for group in (1, 2, 4, 8, 16, 32):
        rows_per_block = BLOCK // group
        for n_rows in (1, rows_per_block - 1, rows_per_block, rows_per_block + 1, 5000):
            blocks = blocks_of_rows(n_rows, group)
            assert (blocks - 1) * rows_per_block < n_rows <= blocks * rows_per_block


def test_staged_rows_are_padded_whole_16_byte_copies_within_the_limit():
    """A Q4_K row of 2048 columns is 1152 bytes: 16 groups of a block stage 16 rows."""
    assert stage_stride(1152, 16) == 1168
    assert stage_stride(1152, 16) % 16 == 0


@pytest.mark.parametrize("group_bytes, groups, want", [
    (0, 8, 0),               # rows staged_bytes refused
    (144, 32, 160),          # a Q4_K row of 256 columns: 32 groups fit
    (2 * 2304, 16, 0)])      # two Q4_K rows of 4096 columns for 16 groups: over STAGE_LIMIT
def test_a_stride_only_where_rows_are_whole_copies_within_the_limit(group_bytes, groups, want):
    assert stage_stride(group_bytes, groups) == want


class _Matrix:
    def __init__(self, row_bytes: int, address: int):
        self.row_bytes = row_bytes
        self.data = type("DeviceArray", (), {"data": type("Pointer", (), {"ptr": address})})


def test_a_group_stages_its_rows_of_the_widest_matrix():
    """q, k (Q4_K, 1152 bytes a row) and v (Q6_K, 1680) of the 30B-A3B shape."""
    assert staged_bytes((_Matrix(1152, 4096), _Matrix(1152, 8192), _Matrix(1680, 12288)), 1) == 1680
    assert staged_bytes((_Matrix(1152, 4096),), 2) == 2304


@pytest.mark.parametrize("row_bytes, address", [(210, 4096), (1152, 4104)])
def test_no_staging_for_rows_that_are_not_aligned_16_byte_copies(row_bytes, address):
    """A Q6_K row of 256 columns beside a Q4_K one; a matrix at an 8-byte aligned address."""
    assert staged_bytes((_Matrix(1152, 4096), _Matrix(row_bytes, address)), 1) == 0
