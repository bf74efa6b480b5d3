"""A GPU parent's copy of the experts that live in host RAM (those homed on CPU daemons), in
page-locked memory mapped for the GPU and in its stored layout, so that the copy engine brings a
layer's set (prefill streaming, moerun.rig.gpu.expert_stream) or one expert (the expert cache,
moerun.rig.gpu.expert_cache) to the device at the bus's full speed, and the GPU's kernels read any of
them in place (moerun.rig.gpu.host_reads).

A layer's host experts are stacked in ascending global id; an expert's position in that stack
is its host index. Shape legend: E experts, N host experts of a layer.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from moerun.backends.gpu import KERNEL_TYPES, DeviceMatrix, device_view, mapped_pinned, stored_tensor
from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec
from moerun.units import format_bytes

FILL_THREADS = 8

logger = logging.getLogger(__name__)


def stored_expert_bytes(gguf: GGUFFile, name: str) -> int:
    """One expert's bytes of an expert tensor as the GPU keeps it (a type its kernels do not read: f16)."""
    info = gguf.tensor(name)
    all_experts, rows, cols = info.shape
    return info.nbytes // all_experts if info.ggml_type in KERNEL_TYPES else 2 * rows * cols


def expert_bytes(gguf: GGUFFile, spec: ModelSpec, layer: int) -> int:
    """One expert's bytes over all its tensors as the GPU keeps them."""
    return sum(stored_expert_bytes(gguf, name) for name in spec.expert_tensor_names(layer))


def marked_runs(which: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive True in `which` [N], in order."""
    edges = np.diff(np.concatenate(([0], which.astype(np.int8), [0])))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


@dataclass
class HostStack:
    """One GGUF tensor's host experts of a layer."""
    data: np.ndarray                   # page-locked uint8 [N, expert_bytes]
    kind: str                          # kernel suffix: q4_k, f16, ...
    rows: int
    cols: int
    pinned: Any                        # the page-locked allocation behind data

    @property
    def expert_bytes(self) -> int:
        return self.data.shape[1]


@dataclass
class HostLayer:
    ids: np.ndarray                    # int32 [N] global ids, ascending
    index: np.ndarray                  # int32 [E] global id -> host index (-1: not in host RAM)
    stacks: list[HostStack]            # per GGUF tensor, in spec.expert_tensor_names order

    @property
    def nbytes(self) -> int:
        return sum(stack.data.nbytes for stack in self.stacks)

    @property
    def expert_bytes(self) -> int:
        return sum(stack.expert_bytes for stack in self.stacks)


class HostExperts:
    def __init__(self, cupy, device_index: int, gguf: GGUFFile, spec: ModelSpec, homes: dict[int, np.ndarray],
                 host_homes: set[int]):
        """homes: the placement's home per expert by MoE layer; host_homes: the daemons whose
        experts are in host RAM (the CPU daemons)."""
        self.cupy = cupy
        self.device_index = device_index
        self.converted: set[str] = set()
        self.layers: dict[int, HostLayer] = {}
        jobs = []
        for layer, layer_homes in sorted(homes.items()):
            ids = np.flatnonzero(np.isin(layer_homes, sorted(host_homes))).astype(np.int32)
            if not len(ids):
                continue
            index = np.full(len(layer_homes), -1, np.int32)
            index[ids] = np.arange(len(ids), dtype=np.int32)
            stacks = [self._stack(gguf, name, len(ids)) for name in spec.expert_tensor_names(layer)]
            self.layers[layer] = HostLayer(ids, index, stacks)
            jobs += [(gguf, name, ids, stack) for name, stack in zip(spec.expert_tensor_names(layer), stacks)]
        with ThreadPoolExecutor(FILL_THREADS) as pool:
            list(pool.map(lambda job: self._fill(*job), jobs))
        if self.layers:
            logger.info(f"{sum(len(h.ids) for h in self.layers.values())} experts of the CPU daemons in page-locked "
                        f"host memory for the GPU ({format_bytes(self.nbytes)})")

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers.values())

    def _stack(self, gguf: GGUFFile, name: str, n_experts: int) -> HostStack:
        info = gguf.tensor(name)
        _, rows, cols = info.shape
        kind = KERNEL_TYPES.get(info.ggml_type, "f16")                   # others are converted to f16
        size = stored_expert_bytes(gguf, name)
        pinned, data = mapped_pinned(self.cupy, n_experts * size)
        return HostStack(data.reshape(n_experts, size), kind, rows, cols, pinned)

    def _fill(self, gguf: GGUFFile, name: str, ids: np.ndarray, stack: HostStack) -> None:
        if gguf.tensor(name).ggml_type in KERNEL_TYPES:
            raw = gguf.raw(name).view(np.uint8).reshape(-1, stack.expert_bytes)      # [E, expert bytes]
            np.take(raw, ids, axis=0, out=stack.data)
        else:
            stored, *_ = stored_tensor(gguf, name, ids.tolist(), self.converted)
            stack.data[:] = stored.reshape(len(ids), -1)

    def copy_experts(self, layer: int, which: np.ndarray, into: list, stream) -> int:
        """The host experts of `layer` marked in `which` [N] into their own places in device
        buffers (uint8, one per tensor), one copy per run of consecutive experts, queued on
        `stream`; returns the bytes copied."""
        copied = 0
        for stack, target in zip(self.layers[layer].stacks, into):
            size = stack.expert_bytes
            for start, end in marked_runs(which):
                target[start * size:end * size].data.copy_from_host_async(stack.data[start].ctypes.data,
                                                                          (end - start) * size, stream)
                copied += (end - start) * size
        return copied

    def copy_expert(self, layer: int, index: int, into: list[DeviceMatrix], position: int, stream) -> None:
        """Host expert `index` of `layer` into expert `position` of device stacks (one per tensor)."""
        for stack, target in zip(self.layers[layer].stacks, into):
            size = stack.expert_bytes
            target.data[position * size:(position + 1) * size].data.copy_from_host_async(
                stack.data[index].ctypes.data, size, stream)

    def mapped_stacks(self, layer: int) -> list[DeviceMatrix]:
        """`layer`'s stacks as DeviceMatrix whose bytes the GPU's kernels read in place, across the bus."""
        return [DeviceMatrix(device_view(self.cupy, stack.pinned, stack.data.nbytes, self.device_index), stack.kind,
                             stack.rows, stack.cols, len(stack.data)) for stack in self.layers[layer].stacks]

    def device_stacks(self, layer: int, buffers: list) -> list[DeviceMatrix]:
        """`layer`'s stacks as DeviceMatrix views of device buffers (uint8, one per tensor)."""
        n_experts = len(self.layers[layer].ids)
        return [DeviceMatrix(buffer[:stack.data.nbytes], stack.kind, stack.rows, stack.cols, n_experts)
                for stack, buffer in zip(self.layers[layer].stacks, buffers)]
