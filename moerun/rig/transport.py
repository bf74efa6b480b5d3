"""How requests reach one daemon: the one place that decides, fallbacks included.

`device`: GPU to GPU through the daemon's device buffers exported over CUDA/HIP IPC (GPUs of
one vendor on one host); `shared`: a shared-memory arena on this host (pinned in both
processes when a GPU is involved); `stream`: ZeroMQ frames, across hosts too. `auto` takes
the first that applies. Two facts are only known by trying: whether the IPC handles open
(device falls back to shared under auto), and whether a GPU parent's kernels can address the
pinned arena (if not, its requests are copied through the host).
"""
from __future__ import annotations

from dataclasses import dataclass

from moerun.rig.links import RigError
from moerun.rig.settings import AUTO

# How the parent's requests reach the daemon's transport.
THROUGH_DEVICE_BUFFERS = "device buffers"     # its kernels write the daemon's IPC buffers
THROUGH_MAPPED_ARENA = "mapped arena"         # its kernels write the pinned arena in place
THROUGH_HOST = "host"                         # host arrays: ZeroMQ frames, or copies into the arena


@dataclass(frozen=True)
class TransportChoice:
    transport: str                  # device | shared | stream: what the daemon is attached with
    parent_side: str                # THROUGH_*
    note: str | None = None         # a fallback taken, said once in the log


@dataclass(frozen=True)
class Facts:
    daemon: str                     # its name in messages: "d0 cuda:1"
    asked: str                      # --transport (or its [[daemon]] table): auto | device | shared | stream
    same_host: bool                 # the daemon runs on this host
    parent_device: str              # cpu | cuda:N | hip:N
    daemon_device: str              # the same, from its HELLO
    parent_maps_arena: bool         # a GPU parent's kernels can address registered host memory

    @property
    def parent_platform(self) -> str:
        return self.parent_device.partition(":")[0]

    @property
    def daemon_platform(self) -> str:
        return self.daemon_device.partition(":")[0]


def choose_transport(facts: Facts, device_failure: str | None = None) -> TransportChoice:
    """The transport for one daemon; `device_failure`: why device-direct did not open when it
    was tried. RigError for an asked transport that cannot work here."""
    gpus_alike = facts.parent_platform != "cpu" and facts.daemon_platform == facts.parent_platform
    if facts.asked != AUTO and facts.asked != "stream" and not facts.same_host:
        raise RigError(f"daemon {facts.daemon} runs on another host: --transport {facts.asked} needs it on this one")
    if facts.asked == "device" and not gpus_alike:
        raise RigError(f"daemon {facts.daemon} computes on {facts.daemon_platform}, the parent on "
                       f"{facts.parent_platform}: --transport device needs both on GPUs of one vendor (use shared)")
    if facts.asked == "stream" or (facts.asked == AUTO and not facts.same_host):
        return TransportChoice("stream", THROUGH_HOST)
    if facts.asked == "device" or (facts.asked == AUTO and gpus_alike):
        if device_failure is None:
            return TransportChoice("device", THROUGH_DEVICE_BUFFERS)
        if facts.asked == "device":
            raise RigError(f"daemon {facts.daemon}: --transport device: {device_failure}")
        note = f"daemon {facts.daemon}: device-direct transport unavailable ({device_failure}); host-staged instead"
    else:
        note = None
    if facts.parent_platform == "cpu":
        return TransportChoice("shared", THROUGH_HOST, note)
    if facts.parent_maps_arena:
        return TransportChoice("shared", THROUGH_MAPPED_ARENA, note)
    unmapped = (f"daemon {facts.daemon}: {facts.parent_device} cannot address the arena from its kernels; "
                f"its requests are copied through the host")
    return TransportChoice("shared", THROUGH_HOST, unmapped if note is None else f"{note}; {unmapped}")
