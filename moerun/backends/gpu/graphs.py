"""Decode steps, and prefill steps of a few tokens, captured as CUDA graphs. A step's device
work comes as a forward function (inputs, positions) -> logits (or a layer shard's hidden
state), its input T <= max_tokens tokens and their positions, or a hidden state [1, H], copied
into buffers of its own. An all-local step is one graph; a step with expert daemons is a
chain of graph segments with host actions between them (post a layer's requests, collect
its replies), cut where the rig's dispatcher calls `backend.device.cut`. A key's first step runs
eagerly (loading every kernel), its second is captured (and runs while it is captured,
segment by segment), later ones replay. Each key's graphs allocate from their own memory
pool, kept with them. The device's `step_guard` (the rig's, when kernels talk to daemons
inside the graphs) opens each captured step before its first launch and settles it after
its last: waits for it, and raises StepRetry when a daemon failed in it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


class StepRetry(Exception):
    """A daemon failed inside a recorded decode step: run the step again eagerly."""


@dataclass
class CapturedStep:
    segments: list[tuple[Any, Callable[[], None]]]    # (graph, the host action after it)
    last: Any                                         # the graph that ends with the logits
    logits: Any
    pool: Any


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
    """Captured steps, one per key (the caller's: cache capacity, all_logits, and whatever
    else the captured work depends on, the step's token count included)."""

    def __init__(self, backend, max_tokens: int):
        self.backend = backend
        self._steps: dict[tuple, CapturedStep] = {}
        self._seen: set[tuple] = set()
        cupy = backend.device.cupy
        self.inputs = cupy.zeros((2, max_tokens), cupy.int32)  # the step's tokens, their positions
        self._host_inputs = backend.device.pinned((2, max_tokens), np.int32)   # one asynchronous copy per step
        self.hidden = cupy.zeros((1, backend.spec.hidden), cupy.float32)   # a layer shard's step input
        self._host_hidden = backend.device.pinned((1, backend.spec.hidden), np.float32)

    def step(self, forward: Callable[[Any, Any], Any], inputs: Any, position: int, key: tuple) -> Any:
        """inputs: the step's tokens [T], or a layer shard's hidden state f32 [1, H] (on the host,
        or on the device: a parent's device-direct hop) -> the step's output on the device (a
        captured step's own buffer, rewritten by its next replay)."""
        backend = self.backend
        hidden = inputs.ndim == 2
        n_tokens = len(inputs)
        self._host_inputs[0, :n_tokens] = 0 if hidden else inputs
        self._host_inputs[1, :n_tokens] = np.arange(position, position + n_tokens)
        self.inputs.set(self._host_inputs, stream=backend.device.stream)
        if hidden and isinstance(inputs, np.ndarray):
            self._host_hidden[:] = inputs
            self.hidden.set(self._host_hidden, stream=backend.device.stream)
        elif hidden:
            self.hidden[...] = inputs
        step_input = self.hidden if hidden else self.inputs[0, :n_tokens]
        positions = self.inputs[1, :n_tokens]
        if key not in self._seen:
            self._seen.add(key)
            return self._eager(forward, step_input, positions)
        try:
            if key not in self._steps:
                self._forget(key)
                self._steps[key] = self._capture(forward, step_input, positions)
            else:
                self._replay(self._steps[key])
        except StepRetry:
            self._forget(key)
            return self._eager(forward, step_input, positions)
        return self._steps[key].logits

    @property
    def captured(self) -> int:
        return len(self._steps)

    @staticmethod
    def _eager(forward: Callable[[Any, Any], Any], step_input: Any, positions: Any) -> Any:
        return forward(step_input, positions)

    def _replay(self, step: CapturedStep) -> None:
        device = self.backend.device
        stream, guard = device.stream, device.step_guard
        device.graph_step = True        # a failing action raises StepRetry instead of falling back
        try:
            if guard is not None:
                guard.open()
            for graph, action in step.segments:
                graph.launch(stream)
                action()
            step.last.launch(stream)
            if guard is not None:
                guard.settle()
        finally:
            device.graph_step = False

    def _capture(self, forward: Callable[[Any, Any], Any], step_input: Any, positions: Any) -> CapturedStep:
        device = self.backend.device
        cupy, guard = device.cupy, device.step_guard
        pool = cupy.cuda.MemoryPool()
        recorder = Recorder(device.stream)
        if guard is not None:
            guard.open()
        device.recorder, device.graph_step = recorder, True
        with cupy.cuda.using_allocator(pool.malloc):
            recorder.start()
            try:
                logits = forward(step_input, positions)
            finally:
                device.recorder, device.graph_step = None, False
                last = recorder.stop() if recorder.capturing else None
        last.launch(device.stream)
        if guard is not None:
            guard.settle()
        return CapturedStep(recorder.segments, last, logits, pool)

    def _forget(self, key: tuple) -> None:
        """Drop the steps captured for the same first two parts of the key (cache capacity
        and all_logits) under another daemon session."""
        for old in [k for k in self._steps if k[:2] == key[:2]]:
            del self._steps[old]
