"""A GPU expert daemon's compute: the experts a parent assigns, copied from the mapped
file into per-layer stacks on the device (index = daemon-local id), run with the
parent's own expert kernels. Padded requests from a GPU parent are served in place:
from the daemon's exported device buffers (transport "device", ordered after the
parent's copy by an IPC event, the reply announced by another) or from the arena,
registered as pinned memory (transport "shared").

Shape legend: T tokens, H hidden, K experts per token, P routed pairs, W the most
pairs of one token.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moerun.backends import open_backend
from moerun.backends.gpu_ipc import ExportedBuffers, copy, record, register_arena, wait
from moerun.backends.gpu_moe import GpuExperts, load_experts
from moerun.backends.gpu_weights import Uploader
from moerun.gguf.reader import GGUFFile
from moerun.ipc.device_slots import DeviceSlots
from moerun.ipc.shm import Arena
from moerun.ipc.slot_headers import DTYPE_CODES
from moerun.models.spec import ModelSpec

ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


class GpuExpertSet:
    def __init__(self, device: str, gguf: GGUFFile, spec: ModelSpec):
        self.backend = open_backend(device, spec)
        self.gguf = gguf
        self.spec = spec
        self.experts = GpuExperts(self.backend, spec, {})
        self.arena: Arena | None = None
        self.transport = ""
        self.slots: DeviceSlots | None = None
        self.exported: ExportedBuffers | None = None
        self._timings: list[tuple[object, object]] = []     # (start, end) events of queued computes
        self._seconds = 0.0

    def load(self, assignment: dict[int, list[int]], progress: Callable[[int, int], None]) -> None:
        """Replace the resident experts with `assignment` (global ids per layer)."""
        self.experts.layers = {}
        uploader = Uploader(self.backend.cupy, self.gguf, lambda nbytes: None)
        total, done = sum(len(ids) for ids in assignment.values()), 0
        layers = {}
        for layer, ids in sorted(assignment.items()):
            layers[layer] = load_experts(uploader, self.spec, layer, ids)
            done += len(ids)
            progress(done, total)
        uploader.finish()
        self.experts.layers = layers

    def compute(self, layer: int, x: np.ndarray, counts: np.ndarray, local_ids: np.ndarray,
                weights: np.ndarray) -> np.ndarray:
        """out[t] = Σ weights · FFN(x[t]) over token t's local experts. x [T, H] -> [T, H]"""
        n_tokens = len(counts)
        width = max(int(counts.max()) if n_tokens else 0, 1)
        slot = np.arange(local_ids.size) - np.repeat(np.cumsum(counts) - counts, counts)
        rows = np.repeat(np.arange(n_tokens), counts)
        ids = np.full((n_tokens, width), -1, np.int32)                  # [T, W], -1: no expert
        padded_weights = np.zeros((n_tokens, width), np.float32)
        ids[rows, slot], padded_weights[rows, slot] = local_ids, weights
        backend, cupy = self.backend, self.backend.cupy
        with backend.stream:
            out = self._timed(layer, cupy.asarray(np.ascontiguousarray(x, np.float32)), cupy.asarray(ids),
                              cupy.asarray(padded_weights))
            return backend.to_host(out)

    # -- padded requests in place ---------------------------------------------------------------

    def attach(self, arena: Arena, transport: str, incoming: list[bytes]) -> dict:
        """Buffers for a parent's arena; the ATTACH reply fields (for "device", the IPC
        handles). `incoming`: the parent's IPC event handles, one per slot ("device")."""
        self.detach()
        cupy = self.backend.cupy
        self.slots = DeviceSlots(arena.layout)
        if transport == "device":
            self.exported = ExportedBuffers(cupy, self.slots.size, incoming)
            fields = {"device_buffers": self.exported.handles()}
        else:
            register_arena(cupy, arena, cupy.cuda.Device().id, mapped=False)
            self._staging = cupy.cuda.Memory(self.slots.size)
            fields = {}
        self.arena, self.transport = arena, transport
        return fields

    def compute_slot(self, index: int, layer: int, dtype: str, tokens: int) -> None:
        """Slot `index`'s padded request: x [T, H] in `dtype`, ids and weights [T, K] -> the
        f32 reply [T, H] in the daemon's buffer ("device": announced by the slot's outgoing
        event, no host wait) or in the arena ("shared": written before this returns)."""
        backend, cupy = self.backend, self.backend.cupy
        stream = backend.stream
        layout = self.arena.layout
        top_k, hidden = layout.max_pairs_per_token, layout.hidden
        buffers = self.slots.buffers(index)
        with stream:
            if self.transport == "device":
                base = self.exported.address
                wait(cupy, stream, self.exported.incoming[index])
            else:      # the arena's frames onto the device first
                base = self._staging.ptr
                x_at, ids_at, weights_at = self.arena.slots[index].frame_addresses()
                copy(cupy, base + buffers.x, x_at, tokens * hidden * ITEMSIZE[dtype], stream)
                copy(cupy, base + buffers.ids, ids_at, tokens * top_k * 4, stream)
                copy(cupy, base + buffers.weights, weights_at, tokens * top_k * 4, stream)
            x = cupy.empty((tokens, hidden), cupy.float32)
            backend.kernels.elementwise("unpack_payload", x.size, (
                np.uint64(base + buffers.x), np.int32(DTYPE_CODES[dtype]), np.int64(x.size), x))
            ids = _device_view(cupy, base + buffers.ids, (tokens, top_k), cupy.int32)
            weights = _device_view(cupy, base + buffers.weights, (tokens, top_k), cupy.float32)
            out = self._timed(layer, x, ids, weights)
            if self.transport == "device":
                copy(cupy, base + buffers.reply, out.data.ptr, out.nbytes, stream)
                record(cupy, self.exported.outgoing[index], stream)
            else:
                copy(cupy, self.arena.slots[index].frame_addresses()[0], out.data.ptr, out.nbytes, stream)
                stream.synchronize()

    def _timed(self, layer: int, x, ids, weights):
        """The experts' output, its device time measured by a pair of events."""
        cupy = self.backend.cupy
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        out = self.experts.begin(layer, x, ids, weights).finish()
        end.record()
        self._timings.append((start, end))
        if len(self._timings) > 256:
            self.device_seconds()
        return out

    def device_seconds(self) -> float:
        """Device time of every compute so far (waits for the queued ones)."""
        cupy = self.backend.cupy
        for start, end in self._timings:
            end.synchronize()
            self._seconds += cupy.cuda.get_elapsed_time(start, end) / 1e3
        self._timings.clear()
        return self._seconds

    def detach(self) -> None:
        self.backend.stream.synchronize()
        if self.exported is not None:
            self.exported.release()
        self.arena, self.exported, self.slots, self.transport = None, None, None, ""
        self._staging = None

    def release(self) -> None:
        self.detach()
        self.experts.layers = {}


def _device_view(cupy, address: int, shape: tuple[int, ...], dtype) -> object:
    """A CuPy array over memory this process does not own (an exported buffer)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    memory = cupy.cuda.UnownedMemory(address, nbytes, None)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))
