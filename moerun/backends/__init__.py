"""Compute backends: numpy (the reference, on the CPU), CUDA and HIP (through CuPy).

Each offers the operations of protocol.Backend on its own arrays (numpy_backend.NumpyBackend
is the plainest statement of them); moerun.engine.model writes the forward pass once over
them.
"""
from __future__ import annotations

from moerun.backends.devices import BackendUnavailable, GpuError, is_gpu_error, parse_device
from moerun.models.spec import ModelSpec

__all__ = ["BackendUnavailable", "GpuError", "is_gpu_error", "open_backend"]


def open_backend(device: str, spec: ModelSpec, graphs: bool = True, threads: int | None = None,
                 kv_dtype: str = "f16"):
    """The backend for `device` (cpu, cuda:N, hip:N); `graphs` False keeps GPU decode eager;
    `threads`: the CPU kernels' on the CPU; `kv_dtype`: a GPU's KV cache elements (f16, f32)."""
    parsed = parse_device(device)
    if parsed.platform == "cpu":
        from moerun.backends.numpy_backend import NumpyBackend
        return NumpyBackend(spec, threads)
    from moerun.backends.gpu.backend import GpuBackend
    return GpuBackend(parsed, spec, graphs=graphs, kv_dtype=kv_dtype)
