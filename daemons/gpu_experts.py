"""A GPU expert daemon's compute: the experts a parent assigns, copied from the mapped
file into per-layer stacks on the device (index = daemon-local id), run with the
parent's own expert kernels. Padded requests from a GPU parent are served in place:
from the daemon's exported device buffers (transport "device", ordered after the
parent's copy by an IPC event, the reply announced by another) or from the arena,
registered as pinned memory (transport "shared"). A one-token request's launches (a decode
step's layer) are captured as a CUDA graph per slot, layer and payload dtype the second time
they come and replayed after, as the parent's decode steps are (not on HIP, nor with graphs off).

Shape legend: T tokens, H hidden, K experts per token, P routed pairs, W the most
pairs of one token.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moerun.backends import open_backend
from moerun.backends.gpu import GpuExperts, Uploader, load_experts
from moerun.backends.gpu.ipc import ExportedBuffers, record, register_arena, wait
from moerun.gguf.reader import GGUFFile
from moerun.ipc.device_slots import DeviceSlots
from moerun.ipc.protocol import DTYPE_CODES, WIRE_ITEMSIZE
from moerun.ipc.shm import Arena
from moerun.models.spec import ModelSpec

TIMED_COMPUTES = 1024          # (start, end) event pairs, harvested when all are used


class GpuExpertSet:
    def __init__(self, device: str, gguf: GGUFFile, spec: ModelSpec, graphs: bool = True):
        self.backend = open_backend(device, spec, graphs=graphs)
        self.gguf = gguf
        self.spec = spec
        self.experts = GpuExperts(self.backend, spec, {})
        self.arena: Arena | None = None
        self.transport = ""
        self.exported: ExportedBuffers | None = None
        cupy = self.backend.device.cupy
        self._timings = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(TIMED_COMPUTES)]
        self._timed_count = 0                                # pairs recorded since the last harvest
        self._seconds = 0.0
        self._views: list[tuple] = []                        # per slot: x, ids, weights, reply at full capacity
        self._staging = None                                 # "shared": the device copy of the slots
        self._graphs: dict[tuple, tuple] = {}                # (slot, layer, dtype) -> (graph, its memory pool)
        self._seen: set[tuple] = set()

    def load(self, assignment: dict[int, list[int]], progress: Callable[[int, int], None]) -> None:
        """Replace the resident experts with `assignment` (global ids per layer)."""
        self._forget_graphs()
        self.experts.layers = {}
        uploader = Uploader(self.backend.device.cupy, self.gguf, lambda nbytes: None)
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
        backend, cupy = self.backend, self.backend.device.cupy
        with backend.device.stream:
            x, ids, padded_weights = (cupy.asarray(np.ascontiguousarray(x, np.float32)), cupy.asarray(ids),
                                      cupy.asarray(padded_weights))
            return backend.to_host(self._timed(lambda: self.experts.compute(layer, x, ids, padded_weights)))

    # -- padded requests in place ---------------------------------------------------------------

    def attach(self, arena: Arena, transport: str, incoming: list[bytes]) -> dict:
        """Buffers for a parent's arena; the ATTACH reply fields (for "device", the IPC
        handles). `incoming`: the parent's IPC event handles, one per slot ("device")."""
        self.detach()
        cupy = self.backend.device.cupy
        slots = DeviceSlots(arena.layout)
        if transport == "device":
            self.exported = ExportedBuffers(cupy, slots.size, incoming)
            base, fields = self.exported.address, {"device_buffers": self.exported.handles()}
        else:
            register_arena(cupy, arena, cupy.cuda.Device().id, mapped=False)
            self._staging = cupy.cuda.Memory(slots.size)
            base, fields = self._staging.ptr, {}
        layout = arena.layout
        rows, pairs = (layout.batch_capacity, layout.hidden), (layout.batch_capacity, layout.max_pairs_per_token)
        self._views = []
        for index in range(layout.slots):
            buffers = slots.buffers(index)
            self._views.append((_device_view(cupy, base + buffers.x, rows, cupy.float32),
                                _device_view(cupy, base + buffers.ids, pairs, cupy.int32),
                                _device_view(cupy, base + buffers.weights, pairs, cupy.float32),
                                _device_view(cupy, base + buffers.reply, rows, cupy.float32)))
        self.arena, self.transport = arena, transport
        return fields

    def compute_slot(self, index: int, layer: int, dtype: str, tokens: int) -> None:
        """Slot `index`'s padded request: x [T, H] in `dtype`, ids and weights [T, K] -> the
        f32 reply [T, H] in the daemon's buffer ("device": announced by the slot's outgoing
        event, no host wait) or in the arena ("shared": written before this returns)."""
        cupy, stream = self.backend.device.cupy, self.backend.device.stream
        layout = self.arena.layout
        top_k, hidden = layout.max_pairs_per_token, layout.hidden
        x, ids, weights, reply = self._views[index]                # full capacity: [C, H], [C, K], [C, K], [C, H]
        with stream:
            if self.transport == "device":
                wait(cupy, stream, self.exported.incoming[index])
            else:      # the arena's frames onto the device first
                x_at, ids_at, weights_at = self.arena.slots[index].frame_addresses()
                self.backend.device.copy_addresses(x.data.ptr, x_at, tokens * hidden * WIRE_ITEMSIZE[dtype])
                self.backend.device.copy_addresses(ids.data.ptr, ids_at, tokens * top_k * 4)
                self.backend.device.copy_addresses(weights.data.ptr, weights_at, tokens * top_k * 4)
            self._timed(lambda: self._slot_experts(index, layer, dtype, tokens))
            if self.transport == "device":
                record(cupy, self.exported.outgoing[index], stream)
            else:
                self.backend.device.copy_addresses(self.arena.slots[index].frame_addresses()[0], reply.data.ptr,
                                                   reply.nbytes)
                stream.synchronize()

    def _slot_experts(self, index: int, layer: int, dtype: str, tokens: int) -> None:
        """Slot `index`'s experts into its reply buffer: a one-token request's launches eager the
        first time for its (slot, layer, dtype), captured the second, replayed after."""
        key, stream = (index, layer, dtype), self.backend.device.stream
        if tokens > 1 or not self.backend.step_tokens:        # 0: no CUDA graphs (HIP, or --no-graph)
            self._launch_slot_experts(index, layer, dtype, tokens)
        elif key not in self._seen:
            self._seen.add(key)
            self._launch_slot_experts(index, layer, dtype, tokens)
        elif key in self._graphs:
            self._graphs[key][0].launch(stream)
        else:
            cupy = self.backend.device.cupy
            pool = cupy.cuda.MemoryPool()                    # the graph's buffers, kept with it
            with cupy.cuda.using_allocator(pool.malloc):
                stream.begin_capture()
                try:
                    self._launch_slot_experts(index, layer, dtype, tokens)
                finally:
                    graph = stream.end_capture()
            self._graphs[key] = graph, pool
            graph.launch(stream)

    def _launch_slot_experts(self, index: int, layer: int, dtype: str, tokens: int) -> None:
        x, ids, weights, reply = self._views[index]
        if dtype == "f32":
            x = x[:tokens]
        else:
            payload, x = x, self.backend.device.cupy.empty((tokens, x.shape[1]), self.backend.device.cupy.float32)
            self.backend.device.elementwise("unpack_payload", x.size, (
                payload, np.int32(DTYPE_CODES[dtype]), np.int64(x.size), x))
        self.experts.compute(layer, x, ids[:tokens], weights[:tokens], reply[:tokens])

    def _timed(self, work: Callable[[], object]) -> object:
        """work()'s result, its device time measured by a pair of events around it."""
        if self._timed_count == len(self._timings):
            self.device_seconds()
        start, end = self._timings[self._timed_count]
        self._timed_count += 1
        start.record()
        out = work()
        end.record()
        return out

    @property
    def captured(self) -> int:
        """One-token requests' launches captured so far (one graph per slot, layer and dtype)."""
        return len(self._graphs)

    def _forget_graphs(self) -> None:
        self.backend.device.stream.synchronize()
        self._graphs, self._seen = {}, set()

    def device_seconds(self) -> float:
        """Device time of every compute so far (waits for the queued ones)."""
        cupy = self.backend.device.cupy
        for start, end in self._timings[:self._timed_count]:
            end.synchronize()
            self._seconds += cupy.cuda.get_elapsed_time(start, end) / 1e3
        self._timed_count = 0
        return self._seconds

    def detach(self) -> None:
        self._forget_graphs()
        if self.exported is not None:
            self.exported.release()
        self.arena, self.exported, self.transport = None, None, ""
        self._staging, self._views = None, []

    def release(self) -> None:
        self.detach()
        self.experts.layers = {}


def _device_view(cupy, address: int, shape: tuple[int, ...], dtype) -> object:
    """A CuPy array over memory this process does not own (an exported buffer)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    memory = cupy.cuda.UnownedMemory(address, nbytes, None)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))
