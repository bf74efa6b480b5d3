"""The expert daemon's request handling: it holds the experts a parent assigns it and computes
them on request, on the CPU (the CPU kernels over its own mmap: nothing to load, so it is
ready at once) or on a GPU (gpu_experts.py). The protocol and the session rules live in
moerun.ipc.server, which calls this as its Handler; moerun.daemons.daemon runs the process.

Shape legend: T tokens, H hidden, P routed pairs (token, expert), F expert FFN width.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from moerun.backends.devices import check_device
from moerun.backends.gpu.ipc import IPC_HANDLE_BYTES, valid_handles
from moerun.backends.numpy_backend import (
    ExpertStore,
    QuantizedExperts,
    expert_store,
    float32_expert_bytes,
)
from moerun.daemons.gpu_experts import GpuExpertSet
from moerun.daemons.slot_server import SlotServer
from moerun.errors import UsageError
from moerun.gguf.reader import GGUFFile
from moerun.ipc.shm import Arena
from moerun.models import load_spec
from moerun.units import available_host_bytes


class ExpertDaemon:
    """The Handler behind moerun.ipc.server.Server for one model file on one device."""

    def __init__(self, model_path: str, device: str, threads: int | None = None, graphs: bool = True):
        """threads: the CPU kernels' (default_threads() if None); graphs: a GPU daemon replays its
        one-token requests' launches as CUDA graphs."""
        self.backend = check_device(device)
        self.device = device
        self.threads = threads
        self.gguf = GGUFFile(model_path)
        self.spec = load_spec(self.gguf)
        self._fingerprint = self.gguf.fingerprint()
        self.assigned: dict[int, np.ndarray] = {}                  # layer -> global ids, index = local id
        self.store: ExpertStore | None = None                      # on the CPU
        self.prefetch: threading.Thread | None = None              # reads the assigned experts' pages ahead
        self.gpu = None if device == "cpu" else GpuExpertSet(device, self.gguf, self.spec, graphs)
        self.arena: Arena | None = None                            # the attached parent's, for a CPU daemon
        self.slot_server: SlotServer | None = None                 # its compiled loop, for these experts
        self.calls = self.tokens = self.pairs = 0
        self.loop_calls = 0                                        # of those, served by the compiled loop
        self.compute_seconds = 0.0

    def info(self) -> dict:
        return {"fingerprint": self._fingerprint, "device": self.device, "backend": self.backend,
                "model": str(self.gguf.path), "n_layers": self.spec.n_layers,
                "n_experts": self.spec.n_experts, "hidden": self.spec.hidden,
                "free_bytes": available_host_bytes()}

    def assign(self, experts: dict[int, list[int]], progress: Callable[[int, int], None]) -> None:
        """Load exactly these experts (global ids per layer) from this daemon's own mmap."""
        self._check_assignment(experts)
        self.assigned.clear()             # the attached arena stays: a new ASSIGN replaces only experts
        self.store = self.slot_server = None
        if self.gpu is not None:
            self.gpu.load(experts, progress)
        else:
            total = sum(len(ids) for ids in experts.values())
            self.store = expert_store(self.gguf, self.spec, cache_bytes=total * float32_expert_bytes(self.spec),
                                      threads=self.threads)
            progress(total, total)
            self._prefetch(experts)
        self.assigned = {layer: np.asarray(ids, np.int64) for layer, ids in experts.items()}

    def _prefetch(self, experts: dict[int, list[int]]) -> None:
        """Have the kernel read the assigned experts' bytes of the file into the page cache, in the
        background: READY goes out at once, and the first requests find most pages there."""
        ranges = [span for layer, ids in experts.items() for name in self.spec.expert_tensor_names(layer)
                  for span in self.gguf.expert_ranges(name, ids)]
        self.prefetch = threading.Thread(target=self.gguf.will_need, args=(ranges,), name="moerun-prefetch",
                                         daemon=True)
        self.prefetch.start()

    def _check_assignment(self, experts: dict[int, list[int]]) -> None:
        for layer, ids in experts.items():
            if not 0 <= layer < self.spec.n_layers or not self.spec.moe_layers[layer]:
                raise UsageError(f"layer {layer} is not a MoE layer of this model")
            if len(set(ids)) != len(ids) or not all(0 <= e < self.spec.n_experts for e in ids):
                raise UsageError(f"layer {layer}: expert ids must be distinct and in 0..{self.spec.n_experts - 1}")

    def compute(self, layer: int, x: np.ndarray, counts: np.ndarray, local_ids: np.ndarray,
                weights: np.ndarray) -> np.ndarray:
        """out[t] = Σ weights · FFN(x[t]) over token t's experts here.  x [T, H] -> [T, H]"""
        started = time.perf_counter()
        experts = self._experts_of(layer)
        try:                        # as uint32 a negative id is out of range too (ids are int32)
            global_ids = experts.take(local_ids.astype(np.uint32, copy=False))      # [P]
        except IndexError:
            raise IndexError(f"layer {layer}: local expert ids must be in 0..{len(experts) - 1}") from None
        if self.gpu is not None:
            out = self.gpu.compute(layer, x, counts, local_ids, weights)
        else:
            rows = np.zeros(len(local_ids), np.int64) if len(counts) == 1 else np.repeat(np.arange(len(counts)), counts)
            out = self.store.grouped_ffn(layer, x, rows, global_ids, weights)
        self._count(len(counts), started, pairs=len(local_ids))
        return out

    def forward(self, sequence: int, start: int, x: np.ndarray) -> np.ndarray:
        raise UsageError("this daemon serves experts; a layer shard is a daemon started with --layers A:B")

    def _count(self, tokens: int, started: float, pairs: int = 0) -> None:
        """One call served, of `tokens` tokens (and `pairs` pairs where counted), since `started`."""
        self.calls += 1
        self.tokens += tokens
        self.pairs += pairs
        self.compute_seconds += time.perf_counter() - started

    def _experts_of(self, layer: int) -> np.ndarray:
        """The global ids of `layer`'s experts here (index = local id); KeyError if none."""
        if layer not in self.assigned:
            raise KeyError(f"no experts of layer {layer} are assigned to this daemon")
        return self.assigned[layer]

    def attach(self, arena: Arena, transport: str, header: dict) -> tuple[dict, Callable | None, Callable | None]:
        """A parent's arena: padded requests are served in place, by a GPU daemon from its device
        buffers (transport "device") or the pinned arena, by a CPU one from the arena's slots (most
        of them in the CPU kernels' own loop)."""
        if self.gpu is None:
            if transport == "device":
                raise UsageError("the device transport needs a GPU daemon; this one computes on the CPU "
                                 "(use --transport shared)")
            self.arena, self.slot_server = arena, None
            return {}, self._compute_cpu_slot, self._serve_pending
        incoming = header.get("incoming", [])
        if transport == "device" and not valid_handles(incoming, arena.layout.slots):
            raise UsageError(f"the device transport needs 'incoming': {arena.layout.slots} IPC event "
                             f"handles of {IPC_HANDLE_BYTES} bytes")
        fields = self.gpu.attach(arena, transport, incoming)
        return fields, self._compute_slot, None

    def _compute_cpu_slot(self, index: int, layer: int, dtype: str, tokens: int) -> None:
        """A padded request (ids and weights [T, K], -1: none) in slot `index`, its result
        written there: the pairs go to the kernels as they are, local ids mapped there."""
        started = time.perf_counter()
        experts = self._experts_of(layer)
        slot, per_token = self.arena.slots[index], self.arena.layout.max_pairs_per_token
        x, _, ids, weights = slot.request_frames(dtype, tokens, tokens * per_token)
        try:
            out = self.store.padded_ffn(layer, x, ids.reshape(tokens, per_token), weights.reshape(tokens, per_token),
                                        experts)
        except (ValueError, IndexError) as e:
            raise UsageError(f"layer {layer}: {e} (this daemon holds {len(experts)} of its experts)") from None
        slot.write_result(out)
        self._count(tokens, started)

    def _serve_pending(self, spin_s: float, max_s: float) -> int:
        """The arena's requests the CPU kernels' loop serves (f32 padded requests of layers held
        here), until it is idle for spin_s or max_s pass; the number served."""
        if not isinstance(self.store, QuantizedExperts) or self.arena is None:
            return 0
        if self.slot_server is None:
            self.slot_server = SlotServer(self.arena, self.store, self.assigned, self.spec.n_layers)
        counts = self.slot_server.serve(spin_s, max_s)
        self.calls += counts.calls
        self.loop_calls += counts.calls
        self.tokens += counts.tokens
        self.compute_seconds += counts.compute_seconds
        return counts.calls

    def _compute_slot(self, index: int, layer: int, dtype: str, tokens: int) -> None:
        started = time.perf_counter()
        self._experts_of(layer)
        self.gpu.compute_slot(index, layer, dtype, tokens)
        self._count(tokens, started)

    def close(self) -> None:
        self.gguf.close()

    def release(self) -> None:
        self.assigned.clear()
        self.store = self.slot_server = None
        self.arena = None
        if self.gpu is not None:
            self.gpu.release()

    def stats(self) -> dict:
        compute_seconds = self.gpu.device_seconds() if self.gpu is not None else self.compute_seconds
        return {"calls": self.calls, "loop_calls": self.loop_calls, "tokens": self.tokens, "pairs": self.pairs,
                "compute_seconds": compute_seconds,
                "captured_steps": self.gpu.captured if self.gpu is not None else 0,
                "experts_loaded": sum(len(ids) for ids in self.assigned.values())}
