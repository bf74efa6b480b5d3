"""How decode attention divides its work (moerun/backends/gpu/backend.py): the splits per row
of blocks and the kernel for a head layout are pure arithmetic, so they are checked here without
a GPU; tests/gpu checks the kernels over them."""
from __future__ import annotations

import pytest

from moerun.backends.gpu.backend import (
    DECODE_CHUNK,
    DECODE_HEAD_TILES,
    DECODE_LANE_DIMS,
    MAX_DECODE_SPLITS,
    attention_splits,
    decode_attention_kernel,
)
from moerun.errors import UsageError

WAVE = 2 * 132          # blocks of attention_decode an H100 holds at once (two a multiprocessor)


@pytest.mark.parametrize("capacity", [4096, 32768, 131072])
def test_one_token_takes_the_most_splits_whatever_the_capacity(capacity):
    """The 30B-A3B shape (4 KV heads, one tile each): the wave would hold 66 splits a row; 64."""
    assert attention_splits(capacity, 4, WAVE) == MAX_DECODE_SPLITS == 64


@pytest.mark.parametrize("span, want", [(1, 1), (64, 1), (65, 2), (256, 4), (1000, 16)])
def test_a_short_span_takes_one_split_per_chunk(span, want):
    assert attention_splits(span, 4, WAVE) == want == -(-span // DECODE_CHUNK)


@pytest.mark.parametrize("rows, want", [(8 * 4, 8), (3 * 16, 5), (2 * WAVE, 1)])
def test_more_tokens_or_heads_take_fewer_splits(rows, want):
    """8 tokens of 4 KV heads, 3 of 16 share the wave; more rows than it holds still get one split."""
    splits = attention_splits(4096, rows, WAVE)
    assert splits == want
    assert splits * rows <= WAVE or splits == 1


@pytest.mark.parametrize("layout, want", [
    ((32, 4, 128, 128), (8, 4)),       # Qwen3-30B-A3B
    ((64, 4, 128, 128), (8, 4)),       # Qwen3-235B-A22B: groups of 16 in two tiles
    ((16, 2, 256, 256), (4, 8)),       # Qwen3.6: no 8-head tile at 8 dims a lane
    ((32, 8, 128, 128), (4, 4)),       # Mixtral
    ((16, 16, 128, 128), (1, 4)),      # MHA
    ((8, 1, 64, 64), (8, 2)),
    ((12, 6, 80, 80), (4, 4)),         # 80 dims: a lane takes 4 of them, the last 12 lanes none
    ((4, 2, 64, 128), (4, 4)),         # key and value heads of different widths
])
def test_the_kernel_fits_the_head_layout(layout, want):
    tile, dims = decode_attention_kernel(*layout)
    assert (tile, dims) == want
    assert tile in DECODE_HEAD_TILES and dims in DECODE_LANE_DIMS
    assert 32 * dims >= max(layout[2:]) and layout[2] % dims == layout[3] % dims == 0


@pytest.mark.parametrize("layout", [(16, 2, 320, 320), (16, 2, 66, 66), (12, 8, 128, 128)])
def test_a_head_layout_no_kernel_takes_is_refused(layout):
    with pytest.raises(UsageError, match="decode attention takes head dims of at most 256"):
        decode_attention_kernel(*layout)
