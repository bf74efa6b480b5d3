"""How a GPU parent reaches its expert daemons, one channel per daemon:

- "device" (both on GPUs of one vendor, one host): the parent's kernel writes each request
  straight into the daemon's device buffers (CUDA/HIP IPC, peer copies over NVLink or PCIe)
  and records its own IPC event; the daemon's stream waits on that event, computes, and
  records one of its own that the parent's stream waits on before it reads the reply from
  the daemon's buffer. The host side is a doorbell in the shared arena; no host waits for
  the device on either side.
- "shared" (any daemon on this host, also across vendors): the arena is registered as
  pinned memory here, the parent's kernel writes the request into it and reads the reply
  from it; the parent waits for its stream before ringing.
- "stream" (ZeroMQ, another host): the request comes to the host and goes out in frames;
  the reply is copied into a landing buffer on the device.

Which one a daemon gets is decided in moerun.rig.transport. Each request is packed by a
kernel (capturable in a CUDA graph) and posted and collected by host actions between graph
segments. Shape legend: T tokens, H hidden, K experts per token, E experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moerun.backends.gpu.ipc import (
    IPC_EVENT_FLAGS,
    ImportedBuffers,
    host_mapping_supported,
    record,
    register_arena,
    wait,
)
from moerun.ipc.device_slots import DeviceSlots
from moerun.ipc.protocol import DTYPE_CODES
from moerun.rig.links import DAEMON_FAILURES, DaemonLink, failure_reason


class GpuAttachments:
    """What a GPU parent keeps of each daemon's attached arena: for "device", its events and
    the daemon's imported buffers; for "shared", the arena registered as pinned memory here.
    Attached from the thread that (re)joins a daemon."""

    def __init__(self, backend):
        self.backend = backend
        self.attached: dict[int, Attached] = {}

    @property
    def maps_arena(self) -> bool:
        """Whether this GPU's kernels reach the pinned arena at its host address."""
        return host_mapping_supported(self.backend.device.cupy, self.backend.device.index)

    def attach_device(self, link: DaemonLink, **layout) -> None:
        """Device-direct: raises TransportUnavailable or a daemon failure when it cannot open."""
        cupy = self._use_device()
        self.release_link(link)
        events = [cupy.cuda.runtime.eventCreateWithFlags(IPC_EVENT_FLAGS) for _ in range(layout["slots"])]
        handles = [bytes(cupy.cuda.runtime.ipcGetEventHandle(e)) for e in events]
        try:
            reply = link.client.attach_shared(transport="device", incoming=handles, **layout)
            imported = ImportedBuffers(cupy, reply.get("device_buffers", {}), layout["slots"])
        except BaseException:
            for event in events:
                cupy.cuda.runtime.eventDestroy(event)
            raise
        self.attached[link.index] = Attached(cupy, "device", events, imported)

    def attach_shared(self, link: DaemonLink, mapped: bool, **layout) -> None:
        """The shared arena; `mapped`: registered here so that kernels write it in place."""
        cupy = self._use_device()
        self.release_link(link)
        link.client.attach_shared(transport="shared", **layout)
        if mapped:
            register_arena(cupy, link.client.arena, self.backend.device.index, mapped=True)
            self.attached[link.index] = Attached(cupy, "shared", [], None)

    def release(self) -> None:
        for attached in self.attached.values():
            attached.release()
        self.attached.clear()

    def _use_device(self):
        cupy = self.backend.device.cupy
        cupy.cuda.Device(self.backend.device.index).use()      # this may run on a watcher thread
        return cupy

    def release_link(self, link: DaemonLink) -> None:
        old = self.attached.pop(link.index, None)
        if old is not None:
            old.release()


@dataclass
class Attached:
    cupy: Any
    transport: str
    incoming: list[int]                  # the parent's events, one per slot ("device")
    imported: ImportedBuffers | None     # the daemon's buffers and events ("device")

    def release(self) -> None:
        """Called when the daemon rejoins or the rig closes: no work that reaches its buffers
        may still be queued on this device."""
        self.cupy.cuda.runtime.deviceSynchronize()
        for event in self.incoming:
            self.cupy.cuda.runtime.eventDestroy(event)
        if self.imported is not None:
            self.imported.release()
        self.incoming, self.imported = [], None


@dataclass
class RemoteCall:
    """One request to one daemon: rows [row0, row0 + T) of a layer's tokens."""
    channel: Any
    layer: int
    row0: int
    tokens: int
    slot: int = 0
    link: Any = None             # the DaemonLink it goes to
    request: int | None = None
    failed: bool = False         # the daemon failed it, or was down: computed on the parent
    on_device: bool = False      # rung and awaited by the parent's kernels (moerun.rig.gpu.rings)
    done: bool = False           # its reply (or the parent's stand-in) is in
    staging: tuple = ()          # "stream": the packed request on the device
    landing: Any = None          # "stream": the reply copied back to the device


class Channel:
    """What every channel shares: its link and session, and the rule that a daemon that
    fails a request is marked down and the call computed on the parent."""

    def __init__(self, backend, rig, link: DaemonLink):
        self.backend, self.rig, self.link = backend, rig, link
        self.session = link.session
        self.dtype, self.timeout_s = rig.config.expert_payload_dtype, rig.config.daemon_timeout_s
        self.outstanding: dict[int, RemoteCall] = {}          # slot -> call posted there, not collected

    def _talk(self, call: RemoteCall, request, posting: bool = False) -> bool:
        """Make a request to the daemon for `call`, holding its link; False (and the call
        failed) when the link is down, in another session, or the request fails."""
        link = self.link
        with link.lock:
            if call.failed or not link.up or link.session != self.session:
                call.failed = True
                return False
            try:
                request()
            except DAEMON_FAILURES as err:
                self.rig.mark_down(link, failure_reason(err, self.timeout_s))
                call.failed = True
                return False
        if posting:
            self.outstanding[call.slot] = call
        return True


class ArenaChannel(Channel):
    """A daemon on this host through its arena: transport "device" or "shared"."""

    def __init__(self, backend, rig, link: DaemonLink, attached: Attached):
        super().__init__(backend, rig, link)
        self.attached = attached
        self.payload_code = DTYPE_CODES[self.dtype]            # the pack kernel writes the payload dtype
        arena = link.client.arena
        self.arena = arena
        self.capacity = arena.layout.batch_capacity
        self.device = attached.transport == "device"
        self.slots = DeviceSlots(arena.layout) if self.device else None
        self._next_slot = 0

    def next_slot(self) -> tuple[int, RemoteCall | None]:
        """The slot the next call uses and the call still outstanding there, if any."""
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.arena.layout.slots
        return slot, self.outstanding.get(slot)

    def destinations(self, call: RemoteCall) -> tuple[int, int, int]:
        """Where the pack kernel writes x, ids and weights for this call."""
        if self.device:
            buffers = self.slots.buffers(call.slot)
            base = self.attached.imported.address
            return base + buffers.x, base + buffers.ids, base + buffers.weights
        return self.arena.slots[call.slot].frame_addresses()

    def reply_address(self, call: RemoteCall) -> int:
        if self.device:
            return self.attached.imported.address + self.slots.buffers(call.slot).reply
        return self.arena.slots[call.slot].frame_addresses()[0]

    def post(self, call: RemoteCall) -> bool:
        cupy, stream = self.backend.device.cupy, self.backend.device.stream
        if self.device:
            record(cupy, self.attached.incoming[call.slot], stream)
        else:
            stream.synchronize()         # the request is in the arena before the doorbell rings
        return self._talk(call, lambda: setattr(call, "request", self.link.client.post(
            call.slot, call.layer, self.dtype, call.tokens)), posting=True)

    def collect(self, call: RemoteCall) -> bool:
        ok = self._talk(call, lambda: self.link.client.collect(call.request, self.timeout_s, self.link.alive))
        self.outstanding.pop(call.slot, None)
        if ok and self.device:
            wait(self.backend.device.cupy, self.backend.device.stream, self.attached.imported.outgoing[call.slot])
        return ok


class HostChannel(Channel):
    """The request through host arrays (ZeroMQ frames, or the arena where this GPU cannot map
    it), the reply copied to the device."""

    payload_code = 0              # f32 on the device: the client encodes the frames itself

    def __init__(self, backend, rig, link: DaemonLink):
        super().__init__(backend, rig, link)
        self.capacity = rig.config.tokens_per_call

    def next_slot(self) -> tuple[int, None]:
        return 0, None                   # ZeroMQ queues any number of requests

    def destinations(self, call: RemoteCall) -> tuple[int, int, int]:
        cupy, spec = self.backend.device.cupy, self.backend.spec
        call.staging = (cupy.empty((call.tokens, spec.hidden), cupy.float32),
                        cupy.empty((call.tokens, spec.n_experts_used), cupy.int32),
                        cupy.empty((call.tokens, spec.n_experts_used), cupy.float32))
        call.landing = cupy.empty((call.tokens, spec.hidden), cupy.float32)
        return tuple(array.data.ptr for array in call.staging)

    def reply_address(self, call: RemoteCall) -> int:
        return call.landing.data.ptr

    def post(self, call: RemoteCall) -> bool:
        x, ids, weights = (array.get(stream=self.backend.device.stream) for array in call.staging)
        present = ids >= 0                                                   # [T, K]
        return self._talk(call, lambda: setattr(call, "request", self.link.client.submit(
            call.layer, x, present.sum(axis=1), ids[present], weights[present], self.dtype)))

    def collect(self, call: RemoteCall) -> bool:
        def receive():
            reply = self.link.client.wait(call.request, self.timeout_s, self.link.alive)
            call.landing.set(np.ascontiguousarray(reply), stream=self.backend.device.stream)
        return self._talk(call, receive)
