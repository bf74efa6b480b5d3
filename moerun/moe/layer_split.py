"""Layer ranges for a layer split by memory (`--split auto`, `moerun plan --split`): a pure
function from each layer's bytes (its weights and its KV cache for the context) and the
devices' memory to one contiguous range of layers per device, in device order. The first
device is the parent's: it keeps layer 0 on, and the embedding and head too.

Each range is cut where the running total crosses the device's share of the model by its
memory (so that layers, and their work, spread in proportion), unless that overfills a
device; then devices are filled in order to what they hold. A device left without a layer
gets no shard. Shape legend: L layers, D devices.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from moerun.backends.kv_types import KVTypes
from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec
from moerun.moe.planner import DeviceBudget, PlanError, recurrent_state_bytes

LAYER_TENSOR = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class LayerBytes:
    per_layer: tuple[int, ...]     # [L] weights + KV cache of each layer
    parent_bytes: int              # what only the parent holds: embedding, output norm, head


@dataclass(frozen=True)
class LayerRange:
    device: DeviceBudget
    layers: range
    used_bytes: int


def layer_bytes(gguf: GGUFFile, spec: ModelSpec, context: int, kv_types: KVTypes) -> LayerBytes:
    """Bytes per layer from the tensor index, with K and V for `context` tokens on attention
    layers and one sequence's recurrent states on DeltaNet layers."""
    per_layer = [0] * spec.n_layers
    parent = 0
    for info in gguf.tensors.values():
        if match := LAYER_TENSOR.match(info.name):
            per_layer[int(match[1])] += info.nbytes
        else:
            parent += info.nbytes
    kv = context * kv_types.token_bytes(spec.n_kv_heads * spec.head_dim_k, spec.n_kv_heads * spec.head_dim_v)
    for layer in range(spec.n_layers):
        per_layer[layer] += recurrent_state_bytes(spec) if spec.is_recurrent(layer) else kv
    return LayerBytes(tuple(per_layer), parent)


def split_layers(sizes: LayerBytes, devices: Sequence[DeviceBudget], reserve_bytes: int = 0) -> list[LayerRange]:
    """One contiguous range per device that gets layers, parent first; `reserve_bytes` stays free on each.
    Layers that all fit on the parent stay there (a hop costs every step time and buys nothing)."""
    room = [device.capacity_bytes - reserve_bytes for device in devices]
    total = sum(sizes.per_layer) + sizes.parent_bytes
    if total <= room[0]:
        return [LayerRange(devices[0], range(len(sizes.per_layer)), total)]
    if total > sum(max(r, 0) for r in room):
        raise PlanError(f"the layers need {_gib(total)} with their KV cache, the devices hold "
                        f"{_gib(sum(max(r, 0) for r in room))} after {_gib(reserve_bytes)} kept free on each: "
                        f"add a device, or lower --ctx")
    ends = _proportional(sizes, room, total)
    if ends is None:
        ends = _filled(sizes, room)
    ranges, start = [], 0
    for device, end in zip(devices, ends):
        if end > start:
            used = sum(sizes.per_layer[start:end]) + (sizes.parent_bytes if start == 0 else 0)
            ranges.append(LayerRange(device, range(start, end), used))
        start = end
    if not ranges or ranges[0].device is not devices[0]:
        raise PlanError(f"the parent's device {devices[0].name} cannot hold layer 0 with the embedding and head "
                        f"({_gib(sizes.per_layer[0] + sizes.parent_bytes)})")
    return ranges


def explain_split(ranges: list[LayerRange]) -> str:
    """What `moerun plan --split` prints: each device's layers and bytes, then the flags."""
    lines = [f"{r.device.name}: layers {r.layers.start}-{r.layers.stop - 1} "
             f"({_gib(r.used_bytes)} of {_gib(r.device.capacity_bytes)})" for r in ranges]
    flags = " ".join(f"--split {r.device.name}@{r.layers.start}" for r in ranges[1:])
    lines.append(f"flags: {flags}" if flags else "every layer fits on the parent: no --split needed")
    return "\n".join(lines)


def _proportional(sizes: LayerBytes, room: list[int], total: int) -> list[int] | None:
    """Ends cut at each device's share of `total` by its room; None when one would overfill."""
    positive = [max(r, 0) for r in room]
    share, ends, running, layer = 0.0, [], sizes.parent_bytes, 0
    for index, r in enumerate(positive):
        share += total * r / sum(positive)
        used = sizes.parent_bytes if index == 0 else 0
        while layer < len(sizes.per_layer) and (index == len(room) - 1 or layer == 0
                                                or running + sizes.per_layer[layer] / 2 <= share):
            running += sizes.per_layer[layer]
            used += sizes.per_layer[layer]
            layer += 1
        if used > room[index] and used > 0:
            return None
        ends.append(layer)
    return ends


def _filled(sizes: LayerBytes, room: list[int]) -> list[int]:
    """Ends with each device filled in order to what it holds."""
    ends, layer = [], 0
    for index, r in enumerate(room):
        used = sizes.parent_bytes if index == 0 else 0
        while layer < len(sizes.per_layer) and used + sizes.per_layer[layer] <= r:
            used += sizes.per_layer[layer]
            layer += 1
        ends.append(layer)
    if layer < len(sizes.per_layer):
        raise PlanError(f"layers {layer}.. do not fit after the devices before them are full: add a device, "
                        f"or lower --ctx")
    return ends


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
