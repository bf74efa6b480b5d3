"""A layer shard: the daemon process started with a layer range (`moerun daemon --layers A:B`)
runs those layers for one parent at a time — their attention with its own KV cache, norms,
routers and every expert of them (or, with expert daemons of its own, its hot ones, the cold
ones on those daemons as a parent's are) — taking the hidden state [T, H] at some positions of a
sequence and giving back the state after its last layer (FORWARD in moerun.ipc.server, over
its socket or, from a parent on this host, through a slot of a shared arena: the state in the
slot, or, from a parent on a GPU of the shard's vendor, in device buffers the shard exports
through CUDA/HIP IPC, ordered by IPC events, neither side's host waiting for a device).
It holds one sequence: position 0 starts one, every other step must continue it, or go back
within it (speculative decoding drops rejected drafts); a shard that restarted, or missed a
step, says so and the parent starts over.

Shape legend: T tokens, H hidden.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from moerun.backends import open_backend
from moerun.backends.gpu.ipc import ExportedBuffers, record, valid_handles, wait
from moerun.backends.kv_types import KVTypes
from moerun.engine.model import MoEModel
from moerun.engine.weights import load_weights
from moerun.errors import UsageError
from moerun.gguf.reader import GGUFFile
from moerun.ipc.shm import Arena
from moerun.models import load_spec
from moerun.moe.executor import LocalExecutor
from moerun.moe.placement import PARENT
from moerun.rig.cores import HostShares, share_host
from moerun.rig.settings import RigConfig
from moerun.rig.supervisor import Rig
from moerun.units import available_host_bytes

EXPERT_CACHE_BYTES = 4 << 30        # the float32 experts kept where the CPU kernels cannot read a type


class LayerShard:
    """The Handler behind moerun.ipc.server.Server for layers `layers` of one model file."""

    def __init__(self, model_path: str, device: str, layers: range, ctx: int, threads: int | None = None,
                 kv_types: KVTypes | None = None, experts: RigConfig | None = None, graphs: bool = True):
        """experts: the shard's own expert daemons (its --daemon and --hot), for its layers' cold
        experts as a parent's; None: it computes every expert of its layers. graphs: one-token
        steps replay captured CUDA graphs, as the parent's decode steps do."""
        self.gguf = GGUFFile(model_path)
        self.rig: Rig | None = None
        self.cpus: HostShares | None = None
        self.exported: ExportedBuffers | None = None     # "device": [x | reply], each [C, H] f32
        self._buffer_rows = 0                            # C, the attached arena's batch capacity
        try:
            self.spec = load_spec(self.gguf)
            if not 1 <= layers.start < layers.stop <= self.spec.n_layers:
                raise UsageError(f"layers {layers.start}:{layers.stop}: a shard runs layers A:B with "
                                 f"1 <= A < B <= {self.spec.n_layers} (the parent keeps layer 0 on)")
            self.device, self.layers, self.ctx = device, layers, ctx
            self._fingerprint = self.gguf.fingerprint()
            if experts is not None and experts.daemons:
                self.cpus = share_host(experts)          # this host's CPUs, with the shard's CPU daemons
                self.cpus.apply_to_parent()
                threads = self.cpus.parent.threads
            self.backend = open_backend(device, self.spec, graphs=graphs, threads=threads, kv_types=kv_types)
            if self.cpus is not None:
                self.rig = Rig(experts, self.gguf, self.spec, self.backend, kv_tokens=ctx, cpus=self.cpus,
                               layers=layers)
            held = self.rig.placement.experts_of(PARENT) if self.rig else None
            weights = load_weights(self.gguf, self.spec, self.backend, held, EXPERT_CACHE_BYTES, layers=layers,
                                   ends=False)
            executor = (self.rig.executor(weights.experts, EXPERT_CACHE_BYTES) if self.rig
                        else LocalExecutor(weights.experts))
            self.model = MoEModel(self.spec, self.backend, weights, executor)
        except BaseException:
            self.close()
            raise
        self.cache = None
        self.sequence: int | None = None
        self.calls = self.tokens = 0
        self.compute_seconds = 0.0

    def info(self) -> dict:
        return {"fingerprint": self._fingerprint, "device": self.device, "backend": self.backend.kind.lower(),
                "model": str(self.gguf.path), "n_layers": self.spec.n_layers, "n_experts": self.spec.n_experts,
                "hidden": self.spec.hidden, "free_bytes": available_host_bytes(),
                "layers": [self.layers.start, self.layers.stop], "ctx": self.ctx}

    def forward(self, sequence: int, start: int, x: np.ndarray) -> np.ndarray:
        """x f32 [T, H] at positions start.. of `sequence` -> f32 [T, H] after layer B-1."""
        self._continue(sequence, start, len(x))
        started = time.perf_counter()
        out = self.model.forward_hidden(x, self.cache)
        self._count(len(x), started)
        return out

    def _forward_slot(self, index: int, sequence: int, start: int, tokens: int) -> None:
        """As forward, the state [T, H] in the exported buffers ("device"): the stream waits for
        the parent's event, runs the layers, writes the reply and records the shard's event;
        the host returns once that is queued."""
        self._continue(sequence, start, tokens)
        exported, cupy, stream = self.exported, self.backend.device.cupy, self.backend.device.stream
        capacity, hidden = self._buffer_rows, self.spec.hidden
        x, reply = (cupy.ndarray((capacity, hidden), cupy.float32, cupy.cuda.MemoryPointer(exported.memory, offset))
                    for offset in (0, capacity * hidden * 4))
        started = time.perf_counter()
        with stream:
            wait(cupy, stream, exported.incoming[index])
            reply[:tokens] = self.model.forward_hidden(x[:tokens], self.cache)
            record(cupy, exported.outgoing[index], stream)
        self._count(tokens, started)

    def _continue(self, sequence: int, start: int, tokens: int) -> None:
        """Position 0 starts `sequence`; any other start must continue the one held, or go back
        within it (the parent dropped a speculative verify's rejected drafts: so does the
        shard's attention; layers with a DeltaNet state cannot go back)."""
        if start == 0:
            self.cache, self.sequence = self.backend.new_cache(self.ctx), sequence
        elif (self.cache is None or sequence != self.sequence or start > self.cache.length
              or (start < self.cache.length and any(self.spec.is_recurrent(i) for i in self.layers))):
            held = ("no sequence" if self.cache is None else
                    f"sequence {self.sequence} at position {self.cache.length}")
            raise UsageError(f"sequence {sequence} at position {start} does not continue what this shard holds "
                             f"({held}): start the sequence again from position 0")
        self.cache.truncate(start)
        if start + tokens > self.ctx:
            raise UsageError(f"positions {start}..{start + tokens - 1} do not fit this shard's context of "
                             f"{self.ctx} (--ctx)")

    def _count(self, tokens: int, started: float) -> None:
        self.calls += 1
        self.tokens += tokens
        self.compute_seconds += time.perf_counter() - started

    def assign(self, experts, progress) -> None:
        raise UsageError(f"a layer shard holds the experts of its layers {self.layers.start}..{self.layers.stop - 1} "
                         f"itself (or gives them to daemons of its own); it takes no ASSIGN")

    def compute(self, layer, x, counts, local_ids, weights) -> np.ndarray:
        raise UsageError("a layer shard takes FORWARD requests, not COMPUTE (start an expert daemon without --layers)")

    def attach(self, arena: Arena, transport: str, header: dict) -> tuple[dict, Callable | None, None]:
        """A parent on this host: its FORWARD requests come through the arena's slots, with the
        hidden state in them ("shared") or in this shard's device buffers ("device": the reply
        fields carry their IPC handles and the shard's events; the parent's events come in
        `header`, one a slot)."""
        self._release_buffers()
        if transport == "shared":
            return {}, None, None
        if transport != "device" or self.backend.kind == "CPU":
            raise UsageError(f"a layer shard on {self.device} takes the hidden state through shared memory "
                             f"or its socket, not the {transport} transport")
        incoming = header.get("incoming", [])
        if not valid_handles(incoming, arena.layout.slots):
            raise UsageError(f"the device transport needs 'incoming': {arena.layout.slots} IPC event handles")
        self._buffer_rows = arena.layout.batch_capacity
        buffer_bytes = 2 * self._buffer_rows * self.spec.hidden * 4
        self.exported = ExportedBuffers(self.backend.device.cupy, buffer_bytes, incoming)
        return {"device_buffers": self.exported.handles()}, self._forward_slot, None

    def _release_buffers(self) -> None:
        if self.exported is not None:
            self.backend.device.stream.synchronize()
            self.exported.release()
            self.exported = None

    def release(self) -> None:
        self._release_buffers()
        self.cache, self.sequence = None, None

    def stats(self) -> dict:
        moe = self.model.moe_stats()
        return {"calls": self.calls, "tokens": self.tokens, "compute_seconds": self.compute_seconds,
                "layers": [self.layers.start, self.layers.stop],
                "positions": 0 if self.cache is None else self.cache.length,
                "captured_steps": self.backend.captured_steps,
                "routed_pairs": moe.routed_pairs, "remote_pairs": moe.remote_pairs,
                "expert_daemons": len(self.rig.links) if self.rig else 0}

    def close(self) -> None:
        """Stop the expert daemons it spawned; release the model file."""
        self._release_buffers()
        if self.rig is not None:
            self.rig.close()
            self.rig = None
        if self.cpus is not None:
            self.cpus.release()
        self.gguf.close()
