"""Prefix snapshots: a sequence's state at some of its positions (the end of a prompt, the end of
an answer, every `interval` tokens of a long prefill), kept in RAM so that a later request whose
tokens begin the same way resumes at the longest such prefix and prefills only the rest. A
hybrid model's recurrent states cannot be cut back to an earlier position as a KV cache can, so
a snapshot holds everything resuming needs: the cache's contents up to its position (a
backend's CacheState) and the logits after its last token.

Shape legend: V vocab.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moerun.backends.protocol import CacheState


@dataclass(frozen=True)
class Snapshot:
    tokens: tuple[int, ...]     # the tokens of positions 0 .. len - 1
    state: CacheState           # the cache after them
    logits: np.ndarray          # [V] f32, after the last of them

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + self.logits.nbytes


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    restored_tokens: int = 0    # positions not prefilled again
    snapshots: int = 0          # taken
    evictions: int = 0


class PrefixCache:
    """At most `slots` snapshots, the least recently used dropped first."""

    def __init__(self, slots: int, interval: int):
        if slots < 1:
            raise ValueError(f"a prefix cache needs at least one slot (got {slots})")
        if interval < 0:
            raise ValueError(f"the snapshot interval must be 0 (at turns only) or more (got {interval})")
        self.slots, self.interval = slots, interval
        self.stats = PrefixStats()
        self._snapshots: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()

    def __len__(self) -> int:
        return len(self._snapshots)

    @property
    def nbytes(self) -> int:
        return sum(snapshot.nbytes for snapshot in self._snapshots.values())

    def longest(self, ids: Sequence[int]) -> Snapshot | None:
        """The snapshot whose tokens are the longest prefix of `ids` (all of them at most)."""
        self.stats.lookups += 1
        ids = tuple(ids)
        best = max((s for key, s in self._snapshots.items() if len(key) <= len(ids) and ids[:len(key)] == key),
                   key=lambda s: len(s.tokens), default=None)
        if best is not None:
            self._snapshots.move_to_end(best.tokens)
            self.stats.hits += 1
            self.stats.restored_tokens += len(best.tokens)
        return best

    def add(self, tokens: Sequence[int], state: CacheState, logits: np.ndarray) -> None:
        key = tuple(tokens)
        if len(key) != state.length:
            raise ValueError(f"a snapshot of {state.length} positions given {len(key)} tokens")
        self._snapshots[key] = Snapshot(key, state, np.array(logits, np.float32).reshape(-1))
        self._snapshots.move_to_end(key)
        self.stats.snapshots += 1
        while len(self._snapshots) > self.slots:
            self._snapshots.popitem(last=False)
            self.stats.evictions += 1

    def due(self, position: int) -> bool:
        """Whether a prefill that reached `position` takes a snapshot there (every `interval`)."""
        return self.interval > 0 and position % self.interval == 0
