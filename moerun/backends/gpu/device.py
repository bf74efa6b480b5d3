"""One GPU as the code around a GpuBackend uses it: the parent's GPU rig (moerun.rig.gpu),
its layer shards and a daemon's GPU compute reach the device through this and nothing else of
the backend. It owns the stream every operation is queued on, launches the kernels, copies
between any two addresses, gives page-locked host memory, runs a host action between device
work (a cut in a captured step), says whether a step is being captured or replayed, and holds
the two hooks the rig sets for every step.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from moerun.backends.devices import Device, gpu_module
from moerun.backends.gpu.library import Kernels

COPY_DEFAULT = 4               # cudaMemcpyDefault: the runtime infers the direction from the addresses


class StepGuard(Protocol):
    """The rig's watch over a captured step (moerun.rig.gpu.rings): opened before its device
    work is launched, settled after; StepRetry from either sends the step to run eagerly."""

    def open(self) -> None: ...

    def settle(self) -> None: ...


class GpuDevice:
    def __init__(self, device: Device):
        self.cupy = gpu_module(device)          # CuPy, or CuPy for ROCm on a HIP device: the arrays' library
        import cupyx
        self._empty_pinned = cupyx.empty_pinned
        self.cupy.cuda.Device(device.index).use()
        self.index = device.index
        self.stream = self.cupy.cuda.Stream(non_blocking=True)
        self.kernels = Kernels(self.cupy)       # the backend's own use: launch and elementwise are the interface
        self.recorder = None                    # set while a step is captured (graphs.py)
        self.graph_step = False                 # a step is being captured or replayed
        self.step_guard: StepGuard | None = None
        self.before_step: Callable[[], None] | None = None   # called before every step, outside any capture

    def set_step_hooks(self, guard: StepGuard | None = None, before_step: Callable[[], None] | None = None) -> None:
        """The rig's hooks: `guard` around every captured step, `before_step` before every step."""
        self.step_guard, self.before_step = guard, before_step

    @property
    def capturing(self) -> bool:
        """Whether a step's device work is being captured now (a host action is then a cut)."""
        return self.recorder is not None

    def launch(self, name: str, grid: tuple, block: tuple, args: tuple, shared_bytes: int = 0) -> None:
        """The kernel `name` of kernels/*.cu on the stream."""
        self.kernels.launch(name, grid, block, args, shared_bytes)

    def elementwise(self, name: str, n: int, args: tuple) -> None:
        """The kernel `name` over n elements, one thread each, on the stream."""
        self.kernels.elementwise(name, n, args)

    def pinned(self, shape: tuple, dtype) -> Any:
        """A page-locked host array (numpy) of CuPy's pool: copies to and from it are asynchronous."""
        return self._empty_pinned(shape, dtype)

    def cut(self, action: Callable[[], None]) -> None:
        """A host action between device work: run now, or between graph segments while a step
        is captured."""
        if self.recorder is not None:
            self.recorder.cut(action)
        else:
            action()

    def copy_addresses(self, destination: int, source: int, nbytes: int) -> None:
        """A copy on the stream between any two addresses this process reaches (device, mapped
        or page-locked host memory, another process's buffer opened through IPC)."""
        if nbytes:
            self.cupy.cuda.runtime.memcpyAsync(destination, source, nbytes, COPY_DEFAULT, self.stream.ptr)

    def hop_through(self, x: Any, destination: int, source: int, action: Callable[[], None]) -> Any:
        """x [T, H] into another process's device buffer at `destination` (opened through IPC),
        the action (its doorbell and event waits: a cut while a step is captured), then [T, H]
        back from its buffer at `source`: no host copy, and the copies are graph nodes."""
        x = self.cupy.ascontiguousarray(x)
        self.copy_addresses(destination, x.data.ptr, x.nbytes)
        self.cut(action)
        out = self.cupy.empty_like(x)
        self.copy_addresses(out.data.ptr, source, x.nbytes)
        return out
