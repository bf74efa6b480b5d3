"""The CUDA and HIP backend (through CuPy): `GpuBackend` (backend.py), its kernels (one source
tree, kernels/*.cu, compiled and launched by library.py, with the numbers both sides share in
constants.py), weights, experts, BLAS and CUDA graphs; and what two GPU processes share on one
host (ipc.py).

What code outside the backends may use of it is named here, and is all that the parent's GPU
rig, its layer shards and a daemon's GPU compute import (tests/unit/test_layers.py): the
device (`GpuDevice`: the stream, launches, copies, page-locked memory, capture state, the
rig's step hooks), the expert and matrix types the rig composes, and moerun.backends.gpu.ipc.
"""
from __future__ import annotations

from moerun.backends.gpu.constants import DAEMON_WORDS
from moerun.backends.gpu.device import GpuDevice, StepGuard
from moerun.backends.gpu.experts import GpuExperts, layer_experts, load_experts, with_room
from moerun.backends.gpu.graphs import StepRetry
from moerun.backends.gpu.library import BLOCK, pointer
from moerun.backends.gpu.weights import KERNEL_TYPES, DeviceMatrix, Uploader, device_view, mapped_pinned, stored_tensor

__all__ = ["BLOCK", "DAEMON_WORDS", "KERNEL_TYPES", "DeviceMatrix", "GpuDevice", "GpuExperts", "StepGuard",
           "StepRetry", "Uploader", "device_view", "layer_experts", "load_experts", "mapped_pinned", "pointer",
           "stored_tensor", "with_room"]
