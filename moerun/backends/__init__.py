"""Compute backends: numpy (the reference, on the CPU), CUDA and HIP (through CuPy).

Each offers the operations of protocol.Backend on its own arrays (numpy_backend.NumpyBackend
is the plainest statement of them); moerun.engine.model writes the forward pass once over
them.
"""
from __future__ import annotations

from moerun.backends.devices import BackendUnavailable, GpuError, is_gpu_error, parse_device
from moerun.backends.kv_types import KVTypes, default_kv_types
from moerun.models.spec import ModelSpec

__all__ = ["BackendUnavailable", "GpuError", "is_gpu_error", "open_backend"]


def open_backend(device: str, spec: ModelSpec, graphs: bool = True, threads: int | None = None,
                 kv_types: KVTypes | None = None):
    """The backend for `device` (cpu, cuda:N, hip:N); `graphs` False keeps GPU decode eager;
    `threads`: the CPU kernels' on the CPU; `kv_types`: its KV caches' elements (None: the
    device's default, default_kv_types)."""
    kv_types = kv_types or default_kv_types(device)
    parsed = parse_device(device)
    if parsed.platform == "cpu":
        from moerun.backends.numpy_backend import NumpyBackend
        return NumpyBackend(spec, threads, kv_types)
    from moerun.backends.gpu.backend import GpuBackend
    return GpuBackend(parsed, spec, graphs=graphs, kv_types=kv_types)
