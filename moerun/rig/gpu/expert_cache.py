"""The expert cache (--expert-cache SIZE): device memory beside a GPU parent's hot experts that
holds the host-RAM experts routing favours now. Each layer's slots follow its hot experts in
the same stacks, so a hit is computed with the hot experts (local ids n_hot.. are slots) and a
miss goes to its CPU daemon as before.

Every step the split kernel counts the routed pairs per expert on the device. Every
REFRESH_STEPS steps, before the step, the counts of the last refresh come back (copied
asynchronously then, so no step waits), decay into scores, and the best-scored host experts
not resident replace the worst-scored residents (at most SWAP_BYTES a refresh). Scores are
routed-pair counts, as noisy as counts are: a newcomer replaces a resident only when its lead is
beyond that noise (NOISE_SIGMAS), else two experts routed alike would trade places every refresh
and the copies would take the host memory's bandwidth from the daemons: an expert leaving is
given back to its daemon in the routing tables first, in stream order; its slot is overwritten
on a copy stream only after every step queued before; the new expert is entered in the tables
once its copy has finished. So no step reads a slot being
written, a step never loses an expert it routes to, and captured steps replay unchanged.
Shape legend: E experts, N host experts of a layer, C slots of a layer.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from moerun.backends.gpu import DeviceMatrix, GpuExperts, layer_experts, with_room
from moerun.rig.gpu.host_experts import HostExperts
from moerun.rig.gpu.routing_tables import RoutingTables
from moerun.units import format_bytes

REFRESH_STEPS = 4
DECAY = 0.95                 # a score's weight after each refresh: the last ~80 steps count
NOISE_SIGMAS = 2.0           # a newcomer's lead over the resident it replaces, in the scores' noise
SWAP_BYTES = 256 << 20       # most bytes copied in by one refresh

logger = logging.getLogger(__name__)


def cache_slots(budget_bytes: int, expert_bytes: dict[int, int], host_experts: dict[int, int]) -> dict[int, int]:
    """Slots per layer: one to each layer in turn while the budget lasts, at most its host experts."""
    slots = dict.fromkeys(expert_bytes, 0)
    left = budget_bytes
    while True:
        given = False
        for layer, size in expert_bytes.items():
            if slots[layer] < host_experts[layer] and size <= left:
                slots[layer] += 1
                left -= size
                given = True
        if not given:
            return {layer: n for layer, n in slots.items() if n}


def clearly_ahead(newcomer: np.ndarray, resident: np.ndarray) -> np.ndarray:
    """Whether newcomers' scores lead residents' by more than NOISE_SIGMAS standard deviations of
    their difference, taking scores as counts (a count's variance is about its mean)."""
    return newcomer - resident > NOISE_SIGMAS * np.sqrt(newcomer + resident)


def choose_swaps(scores: np.ndarray, resident: np.ndarray) -> list[tuple[int, int]]:
    """(slot, host index) pairs that bring the best-scored experts in: scores [N], resident [C]
    (host index per slot, -1: empty). Empty slots first, then the worst-scored residents; a
    newcomer must have been routed to and be clearly ahead of the resident it replaces."""
    outside = np.ones(len(scores), bool)
    outside[resident[resident >= 0]] = False
    candidates = np.flatnonzero(outside & (scores > 0))
    newcomers = candidates[np.argsort(-scores[candidates], kind="stable")]               # best first
    slot_scores = np.where(resident >= 0, scores[np.maximum(resident, 0)], -1.0)          # empty: -1
    slots = np.argsort(slot_scores, kind="stable")[:len(newcomers)]                       # worst first
    newcomers = newcomers[:len(slots)]
    beats = (resident[slots] < 0) | clearly_ahead(scores[newcomers], np.maximum(slot_scores[slots], 0))
    taken = len(beats) if beats.all() else int(np.argmin(beats))
    return list(zip(slots[:taken].tolist(), newcomers[:taken].tolist()))


class ExpertCache:
    def __init__(self, backend, experts: GpuExperts, host: HostExperts, tables: RoutingTables, budget_bytes: int):
        cupy = backend.device.cupy
        self.backend, self.experts, self.host, self.tables = backend, experts, host, tables
        self.slots = cache_slots(budget_bytes, {layer: h.expert_bytes for layer, h in host.layers.items()},
                                 {layer: len(h.ids) for layer, h in host.layers.items()})
        self.n_hot: dict[int, int] = {}
        for layer, n_slots in self.slots.items():
            held = experts.layers.get(layer)
            self.n_hot[layer] = held.n_experts if held is not None else 0
            experts.layers[layer] = (with_room(cupy, held, n_slots) if held is not None
                                     else self._empty(cupy, layer, n_slots))
        self.resident = {layer: np.full(n, -1, np.int64) for layer, n in self.slots.items()}
        self.scores = {layer: np.zeros(len(host.layers[layer].ids)) for layer in self.slots}
        self._rows = {layer: row for row, layer in enumerate(self.slots)}
        self.counts = cupy.zeros((max(1, len(self.slots)), backend.spec.n_experts), cupy.uint32)   # [layers, E]
        self._host_counts = backend.device.pinned(self.counts.shape, np.uint32)
        self._counted: Any = None           # event: the last snapshot of the counts is in _host_counts
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        self._arriving: list[tuple[int, int, int]] = []     # (layer, slot, host index) being copied in
        self._arrived: Any = None           # event: their copies are done
        self.steps = 0
        self.swaps = 0
        self.bytes_in = 0
        self.nbytes = sum(n * host.layers[layer].expert_bytes for layer, n in self.slots.items())
        logger.info(f"expert cache: {sum(self.slots.values())} slots over {len(self.slots)} layers "
                    f"({format_bytes(self.nbytes)})")

    def _empty(self, cupy, layer: int, n_slots: int):
        """Stacks of `n_slots` experts for a layer of which the parent holds none."""
        stacks = [DeviceMatrix(cupy.empty(n_slots * stack.expert_bytes, cupy.uint8), stack.kind, stack.rows,
                               stack.cols, n_slots) for stack in self.host.layers[layer].stacks]
        return layer_experts(stacks, self.backend.spec.expert_ff)

    def routed_counts(self, layer: int) -> Any | None:
        """The device counter row the split kernel counts `layer`'s pairs into; None when the layer has no slots."""
        row = self._rows.get(layer)
        return None if row is None else self.counts[row]

    def before_step(self) -> None:
        """Between steps (the backend calls it): enter finished copies; every REFRESH_STEPS steps
        fold the counts of the last refresh, start the swaps they call for, and snapshot anew."""
        self._enter_arrived()
        self.steps += 1
        if self.steps % REFRESH_STEPS:
            return
        if self._counted is not None:
            if not self._counted.done:
                return
            self._fold()
            if not self._arriving:
                self._swap()
        self.counts.get(stream=self.backend.device.stream, out=self._host_counts)
        self.counts.fill(0)
        self._counted = self.backend.device.stream.record()

    def _fold(self) -> None:
        for layer, row in self._rows.items():
            ids = self.host.layers[layer].ids
            self.scores[layer] = DECAY * self.scores[layer] + self._host_counts[row][ids]

    def _swap(self) -> None:
        """Give the leaving experts back to their daemons, then copy the newcomers into their slots."""
        chosen = []
        for layer in self.slots:
            scores, resident = self.scores[layer], self.resident[layer]
            for slot, newcomer in choose_swaps(scores, resident):
                old = resident[slot]
                gain = scores[newcomer] - (scores[old] if old >= 0 else 0.0)
                chosen.append((gain, layer, slot, newcomer))
        chosen.sort(reverse=True)
        budget = SWAP_BYTES
        for gain, layer, slot, newcomer in chosen:
            size = self.host.layers[layer].expert_bytes
            if size > budget:
                break
            budget -= size
            self._arriving.append((layer, slot, newcomer))
        if not self._arriving:
            return
        for layer, slot, _ in self._arriving:
            old = self.resident[layer][slot]
            if old >= 0:
                self.tables.release(layer, int(self.host.layers[layer].ids[old]))
                self.resident[layer][slot] = -1
        self.tables.upload()
        self.copy_stream.wait_event(self.backend.device.stream.record())
        for layer, slot, newcomer in self._arriving:
            self.host.copy_expert(layer, newcomer, self.experts.layers[layer].stacks, self.n_hot[layer] + slot,
                                  self.copy_stream)
            self.bytes_in += self.host.layers[layer].expert_bytes
        self.swaps += len(self._arriving)
        self._arrived = self.copy_stream.record()

    def _enter_arrived(self) -> None:
        if not self._arriving or not self._arrived.done:
            return
        for layer, slot, newcomer in self._arriving:
            self.tables.hold(layer, int(self.host.layers[layer].ids[newcomer]), self.n_hot[layer] + slot)
            self.resident[layer][slot] = newcomer
        self.tables.upload()
        self._arriving = []
