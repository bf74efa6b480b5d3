"""Decode steps captured as CUDA graphs. An all-local step is one graph; a step with
expert daemons is a chain of graph segments with host actions between them (post a
layer's requests, collect its replies), cut where the model's MoE layers call
`backend.cut`. A key's first step runs eagerly (loading every kernel), its second is
captured (and runs while it is captured, segment by segment), later ones replay. Each
key's graphs allocate from their own memory pool, kept with them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from moerun.moe.dispatch import MoEStats


class StepRetry(Exception):
    """A daemon failed inside a recorded decode step: run the step again eagerly."""


@dataclass
class CapturedStep:
    segments: list[tuple[Any, Callable[[], None]]]    # (graph, the host action after it)
    last: Any                                         # the graph that ends with the logits
    logits: Any
    pool: Any
    replayed_counts: dict[str, int]                   # MoE stats a replay adds (host-counted ones)


class Recorder:
    """Captures the forward pass in segments: cut() ends the current graph, launches it,
    runs the host action, and starts the next graph."""

    def __init__(self, stream):
        self.stream = stream
        self.segments: list[tuple[Any, Callable[[], None]]] = []
        self.capturing = False

    def start(self) -> None:
        self.stream.begin_capture()
        self.capturing = True

    def stop(self) -> Any:
        self.capturing = False
        return self.stream.end_capture()

    def cut(self, action: Callable[[], None]) -> None:
        graph = self.stop()
        graph.launch(self.stream)
        self.segments.append((graph, action))
        action()
        self.start()


class GraphCache:
    """Captured decode steps, one per (cache capacity, all_logits, the MoE's graph key);
    a MoE whose graph key is None (a daemon is down) runs eagerly."""

    def __init__(self, backend):
        self.backend = backend
        self._steps: dict[tuple, CapturedStep] = {}
        self._seen: set[tuple] = set()
        cupy = backend.cupy
        self.token = cupy.zeros(1, cupy.int32)
        self.position = cupy.zeros(1, cupy.int32)

    def step(self, model, token: int, cache, all_logits: bool) -> np.ndarray:
        backend = self.backend
        self.token.fill(token)
        self.position.fill(cache.length)
        moe_key = model.moe.graph_key()
        key = (cache.capacity, all_logits, moe_key)
        if moe_key is None or key not in self._seen:
            self._seen.add(key)
            return self._eager(model, cache, all_logits)
        try:
            if key not in self._steps:
                self._forget(key)
                self._steps[key] = self._capture(model, cache, all_logits)
            else:
                self._replay(model, self._steps[key])
        except StepRetry:
            self._forget(key)
            return self._eager(model, cache, all_logits)
        return backend.to_host(self._steps[key].logits)

    def _eager(self, model, cache, all_logits: bool) -> np.ndarray:
        return self.backend.to_host(model.forward_on_device(self.token, self.position, cache, all_logits))

    def _replay(self, model, step: CapturedStep) -> None:
        stream = self.backend.stream
        self.backend.graph_step = True        # a failing action raises StepRetry instead of falling back
        try:
            for graph, action in step.segments:
                graph.launch(stream)
                action()
        finally:
            self.backend.graph_step = False
        step.last.launch(stream)
        _add_counts(model.moe.stats, step.replayed_counts)

    def _capture(self, model, cache, all_logits: bool) -> CapturedStep:
        cupy, backend = self.backend.cupy, self.backend
        pool = cupy.cuda.MemoryPool()
        before = _counts(model.moe.stats) if model.moe.counts_on_host else {}
        recorder = Recorder(backend.stream)
        backend.recorder, backend.graph_step = recorder, True
        with cupy.cuda.using_allocator(pool.malloc):
            recorder.start()
            try:
                logits = model.forward_on_device(self.token, self.position, cache, all_logits)
            finally:
                backend.recorder, backend.graph_step = None, False
                last = recorder.stop() if recorder.capturing else None
        last.launch(backend.stream)
        replayed = ({name: count - before[name] for name, count in _counts(model.moe.stats).items()}
                    if model.moe.counts_on_host else {})
        return CapturedStep(recorder.segments, last, logits, pool, replayed)

    def _forget(self, key: tuple) -> None:
        """Drop the steps of this capacity and all_logits captured for other daemon sessions."""
        for old in [k for k in self._steps if k[:2] == key[:2]]:
            del self._steps[old]


def _counts(stats: MoEStats) -> dict[str, int]:
    return {field.name: getattr(stats, field.name) for field in fields(stats)}


def _add_counts(stats: MoEStats, counts: dict[str, int]) -> None:
    for name, count in counts.items():
        setattr(stats, name, getattr(stats, name) + count)
