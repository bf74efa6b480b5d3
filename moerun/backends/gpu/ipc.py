"""What two GPU processes share on one host: the arena registered as pinned memory, device
buffers and events exported through CUDA IPC (HIP IPC on ROCm), and the event records and
waits between them (the copies are the backend's copy_addresses). Thin wrappers over the CuPy
runtime module.
"""
from __future__ import annotations

from typing import Any

from moerun.errors import MoerunError
from moerun.ipc.shm import Arena

HOST_REGISTER_PORTABLE, HOST_REGISTER_MAPPED = 1, 2
IPC_EVENT_FLAGS = 4 | 2          # interprocess, no timing
CAN_USE_HOST_POINTER = 91        # device attribute: registered host memory at its own address
IPC_HANDLE_BYTES = 64            # a CUDA/HIP IPC handle (memory or event)


class TransportUnavailable(MoerunError, RuntimeError):
    """This pair of processes cannot use the transport asked for; the message says why."""


def host_mapping_supported(cupy, device_index: int) -> bool:
    """Whether kernels on this GPU reach registered host memory at its host address (the
    GPU parent's side of the shared transport); not relied on under HIP."""
    runtime = cupy.cuda.runtime
    return not runtime.is_hip and bool(runtime.deviceGetAttribute(CAN_USE_HOST_POINTER, device_index))


def register_arena(cupy, arena: Arena, device_index: int, mapped: bool) -> None:
    """Pin the arena's pages for this process's GPU (copies at full speed, never pageable);
    `mapped`: kernels here read and write it at its own address. Undone before it unmaps."""
    runtime = cupy.cuda.runtime
    flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_MAPPED if mapped else 0)
    try:
        runtime.hostRegister(arena.address, arena.layout.size, flags)
    except runtime.CUDARuntimeError as err:
        raise TransportUnavailable(f"cannot register the shared arena as pinned memory: {err}") from None
    arena.before_close.append(lambda: runtime.hostUnregister(arena.address))


class ExportedBuffers:
    """A daemon's device allocation for the device-direct transport, its `outgoing` events
    (recorded when slot i's reply is on the device) and the parent's `incoming` ones
    (recorded by the parent when slot i's request is): each side records only events it
    created on its own device and waits on the other's."""

    def __init__(self, cupy, nbytes: int, incoming: list[bytes]):
        runtime = cupy.cuda.runtime
        self.cupy = cupy
        self.memory = cupy.cuda.Memory(nbytes)          # its own allocation: the IPC handle covers exactly it
        self.address = self.memory.ptr
        self.outgoing = [runtime.eventCreateWithFlags(IPC_EVENT_FLAGS) for _ in incoming]
        self.incoming = [runtime.ipcOpenEventHandle(handle) for handle in incoming]

    def handles(self) -> dict:
        runtime = self.cupy.cuda.runtime
        return {"memory": bytes(runtime.ipcGetMemHandle(self.address)), "bytes": self.memory.size,
                "outgoing": [bytes(runtime.ipcGetEventHandle(e)) for e in self.outgoing]}

    def release(self) -> None:
        for event in self.incoming + self.outgoing:
            self.cupy.cuda.runtime.eventDestroy(event)
        self.incoming, self.outgoing, self.memory = [], [], None


class ImportedBuffers:
    """The parent's view of a daemon's ExportedBuffers: the device address of its
    allocation here and its outgoing events."""

    def __init__(self, cupy, handles: dict, slots: int):
        runtime = cupy.cuda.runtime
        self.cupy = cupy
        if not isinstance(handles.get("memory"), bytes) or len(handles.get("outgoing", ())) != slots:
            raise TransportUnavailable(f"the daemon's ATTACH reply lacks device buffers and {slots} events")
        try:
            self.address = runtime.ipcOpenMemHandle(handles["memory"])
        except runtime.CUDARuntimeError as err:
            raise TransportUnavailable(f"cannot open the daemon's device buffers through IPC ({err}); "
                                       f"both GPUs must be visible to the parent and peer access possible "
                                       f"(or use --transport shared)") from None
        self.outgoing = [runtime.ipcOpenEventHandle(h) for h in handles["outgoing"]]

    def release(self) -> None:
        runtime = self.cupy.cuda.runtime
        for event in self.outgoing:
            runtime.eventDestroy(event)
        runtime.ipcCloseMemHandle(self.address)
        self.outgoing = []


def valid_handles(handles: object, count: int) -> bool:
    """Whether `handles` are `count` IPC handles (a parent's events in an ATTACH request)."""
    return (isinstance(handles, list) and len(handles) == count
            and all(isinstance(h, bytes) and len(h) == IPC_HANDLE_BYTES for h in handles))


def record(cupy, event: int, stream: Any) -> None:
    cupy.cuda.runtime.eventRecord(event, stream.ptr)


def wait(cupy, stream: Any, event: int) -> None:
    """Later work on `stream` waits for the event's last record (no host wait)."""
    cupy.cuda.runtime.streamWaitEvent(stream.ptr, event, 0)
