"""The forward pass of a MoE transformer over a backend's operations (moerun.backends: numpy
on the CPU, CUDA or HIP on a GPU): the embedding, the layers as the model's architecture
composes them (moerun.models.registry), the layer shards' hop, the head; each MoE layer's routed
experts go through the executor it is given (moerun.moe.executor: all local, or a rig).

Shape legend: T tokens in the chunk, H hidden, V vocab, L layers.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from moerun.backends.protocol import Backend, KVCache
from moerun.engine.weights import ModelWeights
from moerun.errors import UsageError
from moerun.models.blocks import Segment, Step
from moerun.models.registry import architecture
from moerun.models.spec import ModelSpec
from moerun.moe.executor import ExpertExecutor, MoEStats
from moerun.moe.hotness import RoutingCounter


class Shards(Protocol):
    """The layers after this process's, on layer shards (moerun.rig.shards)."""

    def hop(self, x: Any, start: Callable[[], int]) -> Any:
        """x [T, H] on the model's backend at positions start().. through every shard -> [T, H] there."""

    def graph_key(self) -> tuple: ...   # what a captured step's hops depend on (the shards' device buffers)


class MoEModel:
    def __init__(self, spec: ModelSpec, backend: Backend, weights: ModelWeights, executor: ExpertExecutor,
                 routing: RoutingCounter | None = None, shards: Shards | None = None):
        """routing: counts every MoE layer's routed ids (`moerun profile`); steps then run eagerly.
        weights: the layers this process runs; shards: the ones after them, whose hidden state
        crosses between graph segments of a captured step."""
        self.spec = spec
        self.backend = backend
        self.weights = weights
        self.executor = executor
        self.routing = routing
        self.shards = shards
        self.architecture = architecture(spec)
        self.layer_ids = range(weights.first_layer, weights.first_layer + len(weights.layers))
        self._moe_layers = sum(spec.moe_layers[i] for i in self.layer_ids)
        self._layer_calls = 0             # MoE layer calls and routed pairs, counted per forward
        self._routed_pairs = 0
        self._start = 0                   # the position the current step starts at

    def forward(self, ids: np.ndarray, cache: KVCache, all_logits: bool) -> np.ndarray:
        """Run ids [T] at positions cache.length.. and extend the cache.
        Returns float32 logits [T, V] (all_logits) or [1, V] for the last position."""
        cache.reserve(len(ids))
        self._start = cache.length
        graph_key = self._graph_key(cache, all_logits, len(ids))
        logits = self.backend.run_step(
            lambda ids_, positions: self._forward(ids_, positions, cache, all_logits), ids, self._start, graph_key)
        self._count(cache, len(ids))
        return logits

    def forward_batch(self, batch: Sequence[tuple[np.ndarray, KVCache]],
                      last: Sequence[int] | None = None) -> np.ndarray:
        """Several sequences in one step: each its ids [T_b] at positions cache.length.. of its own
        cache, their tokens through the layers together (each sequence's attention over its own
        cache) -> float32 logits [Σ last_b, V] of each sequence's last last_b positions (default 1:
        [B, V]; a speculative verify's, all of them), in order; each cache extended. Eager, on a
        backend whose positions are host arrays (the CPU parent), without layer shards."""
        if self.shards is not None or self.backend.kind != "CPU":
            raise UsageError("batched steps run on a CPU parent without --split for now")
        segments, first = [], 0
        for ids, cache in batch:
            cache.reserve(len(ids))
            segments.append(Segment(cache, cache.length + np.arange(len(ids)), slice(first, first + len(ids))))
            first += len(ids)
        ids = np.concatenate([np.asarray(ids, np.int64) for ids, _ in batch])
        last = last if last is not None else [1] * len(segments)
        last_rows = [row for segment, n in zip(segments, last)
                     for row in range(segment.rows.stop - n, segment.rows.stop)]
        logits = self.backend.run_step(lambda ids_, _: self._run(ids_, tuple(segments), last_rows), ids, 0, None)
        for ids_b, cache in batch:
            self._count(cache, len(ids_b))
        return logits

    def forward_tree(self, ids: np.ndarray, parents: Sequence[int], cache: KVCache) -> np.ndarray:
        """A speculative tree's verify: ids [W] (the sampled token, then the drafts, each after its
        parent: parents[j] the index among the drafts, -1 the sampled token), written at the cache's
        next W rows, each at the position after its parent's and attending to its ancestors and
        itself -> float32 logits [W, V] after each; the cache extended by W rows (the caller keeps
        the accepted path's). Eager, on the CPU parent, attention-only models, without shards."""
        if self.shards is not None or self.backend.kind != "CPU" or self.spec.delta_net is not None:
            raise UsageError("tree verifies run on a CPU parent, attention-only models, without --split for now")
        among = ancestry(parents)                                            # [W, W]
        cache.reserve(len(ids))
        positions = cache.length + among.sum(axis=1) - 1                     # the depth of each node
        logits = self._run(np.asarray(ids, np.int64), (Segment(cache, positions, slice(0, len(ids)), among),), None)
        self._count(cache, len(ids))
        return logits

    def forward_hidden(self, x: Any, cache: KVCache) -> Any:
        """A layer shard's step: x f32 [T, H] at positions cache.length.. through this
        process's layers, extending the cache -> f32 [T, H], on the host, or, for x on the
        backend's device (a parent's device-direct hop), there, queued on its stream."""
        cache.reserve(len(x))
        if isinstance(x, np.ndarray):
            x = np.ascontiguousarray(x, np.float32)
        out = self.backend.run_step(
            lambda hidden, positions: self._layers(hidden, (Segment(cache, positions, slice(0, len(hidden))),)),
            x, cache.length, self._graph_key(cache, "hidden", len(x)))
        self._count(cache, len(x))
        return out

    @property
    def step_tokens(self) -> int:
        return self._step_tokens(self._executor_key())

    def _executor_key(self) -> tuple | None:
        """The executor's state a captured step depends on; None where steps run eagerly
        (counting the routing, or a daemon down)."""
        return self.executor.graph_key() if self.routing is None else None

    def _step_tokens(self, executor_key: tuple | None) -> int:
        """The most tokens of a step that replays captured work: the backend's without expert
        daemons, one with them (their requests are captured for decode steps only), 0 where
        steps run eagerly."""
        if executor_key is None:
            return 0
        return self.backend.step_tokens if executor_key == () else min(1, self.backend.step_tokens)

    def _graph_key(self, cache: KVCache, output: bool | str, n_tokens: int) -> tuple | None:
        """What a captured step depends on: the cache's capacity, what it returns, the
        executor's state, the step's tokens and the layer shards' buffers; None where the step
        runs eagerly."""
        executor_key = self._executor_key()
        if n_tokens > self._step_tokens(executor_key):
            return None
        return cache.capacity, output, executor_key, n_tokens, self.shards.graph_key() if self.shards else ()

    def _count(self, cache: KVCache, n_tokens: int) -> None:
        cache.advance(n_tokens)
        self._layer_calls += self._moe_layers
        self._routed_pairs += self._moe_layers * n_tokens * self.spec.n_experts_used

    def moe_stats(self) -> MoEStats:
        return MoEStats.of(self._layer_calls, self._routed_pairs, self.executor.counts())

    def _forward(self, ids: Any, positions: Any, cache: KVCache, all_logits: bool) -> Any:
        """The pass on the backend's arrays: ids [T], positions [T] -> logits. Launches device
        work only (host actions go through the backend's cuts and hops), so a GPU backend can
        capture it as a graph; the layer shards, where there are any, take the hidden state
        between this process's layers and the head, device to device or through the host (at
        the step's own start when a captured step replays)."""
        return self._run(ids, (Segment(cache, positions, slice(0, len(ids))),), None if all_logits else -1)

    def _run(self, ids: Any, segments: tuple[Segment, ...], out_rows: int | list[int] | None) -> Any:
        """The embedding, the layers, the hop to the layer shards, the head over the rows `out_rows`
        (-1: the last, as [1, V]; a list: those; None: every row)."""
        backend, weights = self.backend, self.weights
        x = self._layers(backend.embed(weights.token_embd, ids), segments)                  # [T, H]
        if self.shards is not None:
            x = self.shards.hop(x, lambda: self._start)
        if out_rows == -1:
            x = x[-1:]
        elif out_rows is not None:
            x = x[out_rows]
        return backend.linear(backend.rms_norm(x, weights.output_norm), weights.output)   # [T, V]

    def _layers(self, x: Any, segments: tuple[Segment, ...]) -> Any:
        """x [T, H] through the layers this process runs, each as its architecture composes it -> [T, H]."""
        step = Step(self.backend, self.spec, self.executor, self.routing, segments)
        for i, layer in zip(self.layer_ids, self.weights.layers):
            x = self.architecture.layer(step, i, layer, x)
        return x


def ancestry(parents: Sequence[int]) -> np.ndarray:
    """[W, W] bool of a tree of W nodes, the sampled token (node 0) and the drafts (node j + 1,
    under node parents[j] + 1): row n marks n's ancestors and n itself."""
    among = np.eye(len(parents) + 1, dtype=bool)
    for j, parent in enumerate(parents):
        among[j + 1] |= among[parent + 1]
    return among
