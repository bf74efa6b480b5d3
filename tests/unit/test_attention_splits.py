"""How many splits per head decode attention takes (moerun/backends/gpu/backend.py): pure
arithmetic, so it is checked here without a GPU; tests/gpu checks the kernels over them."""
from __future__ import annotations

import pytest

from moerun.backends.gpu.backend import DECODE_CHUNK, attention_splits

WAVE = 5 * 132          # blocks of attention_partial an H100 holds at once (46 registers)


@pytest.mark.parametrize("capacity", [4096, 32768, 131072])
def test_one_token_fills_one_wave_whatever_the_capacity(capacity):
    """The 30B-A3B shape (32 heads): 20 splits per head, 640 blocks, at 4096 positions as at 128k."""
    assert attention_splits(capacity, 32, WAVE) == 20


@pytest.mark.parametrize("span, want", [(1, 1), (64, 1), (65, 2), (256, 4), (1000, 16)])
def test_a_short_span_takes_one_split_per_chunk(span, want):
    assert attention_splits(span, 32, WAVE) == want == -(-span // DECODE_CHUNK)


@pytest.mark.parametrize("heads, want", [(8 * 32, 2), (3 * 32, 6), (2 * WAVE, 1)])
def test_more_tokens_or_heads_take_fewer_splits(heads, want):
    """8 or 3 tokens of 32 heads share the wave; more heads than it holds still get one split."""
    splits = attention_splits(4096, heads, WAVE)
    assert splits == want
    assert splits * heads <= WAVE or splits == 1
