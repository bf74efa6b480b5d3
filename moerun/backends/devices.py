"""Device names (`cpu`, `cuda:N`, `hip:N`) and what each needs to be present.

CUDA runs through CuPy built for CUDA (extras `cuda12`/`cuda13`); HIP through
CuPy built for ROCm (extra `rocm`). `hip:N` picks the HIP backend by itself when
the ROCm build is installed, and says what is missing when it is not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from moerun.errors import MoerunError, UsageError

DEVICE_PATTERN = re.compile(r"^(cpu|cuda:\d+|hip:\d+)$")


class BackendUnavailable(MoerunError, RuntimeError):
    """The device named cannot be used here; the message says what is missing."""


class GpuError(MoerunError, RuntimeError):
    """A GPU operation failed: a kernel that could not be launched, or an error the device reported
    (an illegal address or instruction in a kernel, memory exhausted). CUDA reports a kernel's fault
    at a later call, so the kernel named may not be the one at fault; CUDA_LAUNCH_BLOCKING=1
    reports each where it happens."""

    def __init__(self, operation: str, error: Exception):
        super().__init__(f"the GPU failed in {operation}: {error} (run again with CUDA_LAUNCH_BLOCKING=1 to "
                         f"name the kernel at fault; please report it with the model's `moerun inspect`)")


def is_gpu_error(error: BaseException) -> bool:
    """Whether `error` is one CuPy raises for the device (checked by module: CuPy need not be installed)."""
    return type(error).__module__.startswith(("cupy_backends.cuda", "cupy.cuda"))


@dataclass(frozen=True)
class Device:
    platform: str     # cpu | cuda | hip
    index: int

    @property
    def name(self) -> str:
        return "cpu" if self.platform == "cpu" else f"{self.platform}:{self.index}"


def parse_device(name: str) -> Device:
    if not DEVICE_PATTERN.match(name):
        raise UsageError(f"--device {name!r}: expected cpu, cuda:N or hip:N")
    platform, _, index = name.partition(":")
    return Device(platform, int(index or 0))


def gpu_module(device: Device):
    """The CuPy module, checked to drive `device`'s platform and to see the device."""
    install = ("pip install 'moerun[cuda12]' (CUDA 12) or pip install 'moerun[cuda13]' (CUDA 13)"
               if device.platform == "cuda" else "pip install 'moerun[rocm]'")
    try:
        import cupy
    except ImportError:
        raise BackendUnavailable(
            f"{device.name} needs CuPy for {device.platform.upper()}: {install}"
        ) from None
    is_hip = bool(getattr(cupy.cuda.runtime, "is_hip", False))
    if is_hip != (device.platform == "hip"):
        built_for, other = ("ROCm", "hip") if is_hip else ("CUDA", "cuda")
        raise BackendUnavailable(
            f"{device.name}: the installed CuPy is built for {built_for}; use --device {other}:N, "
            f"or install the {device.platform.upper()} build ({install})"
        )
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # noqa: BLE001 - the driver or runtime library is missing or broken
        runtime = "ROCm" if is_hip else "the NVIDIA driver"
        raise BackendUnavailable(f"{device.name}: no usable GPU ({runtime}: {err})") from None
    if device.index >= count:
        raise BackendUnavailable(f"{device.name}: this machine has {count} {device.platform.upper()} device(s)")
    return cupy


def check_device(device: str) -> str:
    """The backend name for a device string (numpy, cuda or hip), what both a parent and an expert
    daemon check before they use one; UsageError for a malformed one, BackendUnavailable saying
    what is missing for one this machine cannot drive."""
    parsed = parse_device(device)
    if parsed.platform != "cpu":
        gpu_module(parsed)
    return "numpy" if parsed.platform == "cpu" else parsed.platform
