"""Memory on a backend's device, as `moerun bench` reports it (docs/stats.md).

- GPU: bytes in use on the whole device, total - free as the driver reports them
  (cudaMemGetInfo / hipMemGetInfo): what nvidia-smi shows for the device, the figure to compare
  with another runtime's. It holds the CUDA or HIP context, every block CuPy's memory pool holds
  (the freed ones it keeps for reuse included), cuBLAS workspaces, and the memory of any other
  process on the device. The pool never hands blocks back by itself, so a sample taken after
  some work covers that work's peak.
- CPU: the process's peak resident set so far (getrusage ru_maxrss): host RAM is the CPU
  device's memory, and the current resident set would miss a prefill's activations once it ends.
  Weights are read from the mmap'd model file, so they count as far as they were touched.
"""
from __future__ import annotations

import resource
import sys

from moerun.backends.protocol import Backend

RU_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024    # macOS reports bytes, Linux KiB


def device_memory_used(backend: Backend) -> int:
    """Bytes in use on a GPU backend's device now; on the CPU, the most this process has held
    in RAM so far. Either way the largest of a run's samples is its peak."""
    if backend.kind == "CPU":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RU_MAXRSS_UNIT
    cupy = backend.device.cupy
    with cupy.cuda.Device(backend.device.index):
        free, total = cupy.cuda.runtime.memGetInfo()
    return total - free


def device_memory_free(backend: Backend) -> int:
    """Bytes free on a GPU backend's device now (the CPU backend: none of this applies, raises)."""
    if backend.kind == "CPU":
        raise ValueError("the CPU backend's memory is the host's: see moerun.units.available_host_bytes")
    cupy = backend.device.cupy
    with cupy.cuda.Device(backend.device.index):
        free, _ = cupy.cuda.runtime.memGetInfo()
    return free
