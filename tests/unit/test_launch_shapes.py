"""How a row-parallel kernel's threads are grouped (moerun/backends/gpu/library.py): pure
arithmetic, so it is checked here without a GPU."""
from __future__ import annotations

import pytest

from moerun.backends.gpu.library import (
    BLOCK,
    ROW_GROUP,
    STAGE_LIMIT,
    blocks_of_rows,
    fitting_group,
    row_group,
    stage_stride,
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


def test_a_slot_holds_its_rows_at_any_offset_within_16_bytes_plus_a_bank_step():
    """Two Q4_K rows of 2048 columns (2304 bytes) for 8 groups; a warp's 4 Q6_K rows of 768
    columns (2520 bytes, 2-byte aligned) for 8 warps."""
    assert stage_stride(2304, 8) == 2304 + 16 + 16
    assert stage_stride(2520, 8) == 2544 + 16
    for slot_bytes in (1, 15, 16, 17, 630, 2520):
        stride = stage_stride(slot_bytes, 1)
        assert stride % 16 == 0 and stride - 16 >= slot_bytes + 15


def test_no_stride_where_a_block_would_pass_the_limit():
    """Two Q4_K rows of 4096 columns for 16 groups: 74 KB."""
    assert stage_stride(2 * 2304, 16) == 0
    assert stage_stride(2 * 2304, 8) * 8 <= STAGE_LIMIT
