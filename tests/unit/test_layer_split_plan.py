"""The layer split by memory (moerun.moe.layer_split): contiguous ranges in device order, in
proportion to the devices' memory where that fits, filled in order where it does not, and a
clear error where nothing does."""
from __future__ import annotations

import pytest

from moerun.moe.layer_split import LayerBytes, explain_split, split_layers
from moerun.moe.planner import DeviceBudget, PlanError

GIB = 1 << 30


def devices(*sizes_gib: float) -> list[DeviceBudget]:
    names = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    return [DeviceBudget(name, int(size * GIB), is_parent=index == 0)
            for index, (name, size) in enumerate(zip(names, sizes_gib))]


def layers_of(ranges) -> list[tuple[str, int, int]]:
    return [(r.device.name, r.layers.start, r.layers.stop) for r in ranges]


def test_equal_devices_take_equal_halves():
    sizes = LayerBytes((2 * GIB,) * 48, parent_bytes=0)
    assert layers_of(split_layers(sizes, devices(80, 80))) == [("cuda:0", 0, 24), ("cuda:1", 24, 48)]


def test_layers_that_fit_on_the_parent_stay_there():
    ranges = split_layers(LayerBytes((GIB // 2,) * 48, parent_bytes=GIB), devices(80, 80))
    assert layers_of(ranges) == [("cuda:0", 0, 48)] and ranges[0].used_bytes == 25 * GIB
    assert explain_split(ranges).endswith("every layer fits on the parent: no --split needed")


def test_ranges_follow_the_memory_and_the_parent_counts_its_head():
    sizes = LayerBytes((GIB,) * 30, parent_bytes=2 * GIB)
    ranges = split_layers(sizes, devices(24, 12))          # 32 GiB in all: 2/3 and 1/3
    assert layers_of(ranges) == [("cuda:0", 0, 19), ("cuda:1", 19, 30)]
    assert ranges[0].used_bytes == 21 * GIB and ranges[1].used_bytes == 11 * GIB


def test_shares_that_would_overfill_a_device_fall_back_to_filling_in_order():
    """Cut at the shares, the second device would get layers 2-3 (4 GiB in 3.5); filled in
    order, layer 3 is left over: no split of these layers fits."""
    sizes = LayerBytes((3 * GIB, 3 * GIB, 3 * GIB, GIB), parent_bytes=0)
    with pytest.raises(PlanError, match="layers 3.. do not fit after the devices before them are full"):
        split_layers(sizes, devices(6.5, 3.5))


def test_a_device_whose_share_rounds_to_no_layer_gets_no_shard():
    sizes = LayerBytes((GIB,) * 4, parent_bytes=0)
    ranges = split_layers(sizes, devices(100, 1))
    assert layers_of(ranges) == [("cuda:0", 0, 4)]
    assert explain_split(ranges).endswith("every layer fits on the parent: no --split needed")


def test_too_little_memory_in_all_is_an_error():
    with pytest.raises(PlanError, match="the layers need 48.00 GiB .* the devices hold 40.00 GiB"):
        split_layers(LayerBytes((GIB,) * 48, parent_bytes=0), devices(20, 20))


def test_a_parent_that_cannot_hold_layer_0_and_the_head_is_an_error():
    with pytest.raises(PlanError, match="cannot hold layer 0"):
        split_layers(LayerBytes((GIB,) * 8, parent_bytes=3 * GIB), devices(2, 100))


def test_reserved_memory_counts_on_every_device():
    sizes = LayerBytes((GIB,) * 10, parent_bytes=0)
    with pytest.raises(PlanError, match="after 1.00 GiB kept free on each"):
        split_layers(sizes, devices(5, 5.5), reserve_bytes=GIB)


def test_the_explanation_gives_the_flags():
    text = explain_split(split_layers(LayerBytes((2 * GIB,) * 48, parent_bytes=0), devices(80, 80)))
    assert text.splitlines() == ["cuda:0: layers 0-23 (48.00 GiB of 80.00 GiB)",
                                 "cuda:1: layers 24-47 (48.00 GiB of 80.00 GiB)",
                                 "flags: --split cuda:1@24"]
