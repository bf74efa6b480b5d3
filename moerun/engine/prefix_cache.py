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
from pathlib import Path

import numpy as np

from moerun.backends.protocol import CacheState, KVCache
from moerun.engine.snapshot_store import Snapshot, SnapshotStore, longest_prefix
from moerun.errors import UsageError


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    restored_tokens: int = 0    # positions not prefilled again
    snapshots: int = 0          # taken
    evictions: int = 0          # from RAM
    disk_hits: int = 0          # of the hits, read from disk


class PrefixCache:
    """At most `slots` snapshots in RAM, the least recently used dropped first; with a folder,
    every snapshot also written there (engine/snapshot_store.py, at most `disk_budget` bytes),
    where a restarted server finds them."""

    def __init__(self, slots: int, interval: int, folder: str | Path | None = None, disk_budget: int = 0):
        if slots < 1:
            raise UsageError(f"a prefix cache needs at least one slot (got {slots})")
        if interval < 0:
            raise UsageError(f"the snapshot interval must be 0 (at turns only) or more (got {interval})")
        self.slots, self.interval = slots, interval
        self.folder, self.disk_budget = folder, disk_budget
        self.store: SnapshotStore | None = None
        self.stats = PrefixStats()
        self._snapshots: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()

    def open_store(self, fingerprint: str, layout: str) -> None:
        """Use the folder's snapshots of this model file and cache layout (a runtime calls this
        once it has loaded the model)."""
        if self.folder is not None:
            self.store = SnapshotStore(self.folder, self.disk_budget, fingerprint, layout)

    def close(self) -> None:
        """Finish writing to the folder (a runtime calls this as it closes)."""
        if self.store is not None:
            self.store.close()
            self.store = None

    def __len__(self) -> int:
        return len(self._snapshots)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self._snapshots

    @property
    def nbytes(self) -> int:
        return sum(snapshot.nbytes for snapshot in self._snapshots.values())

    def longest(self, ids: Sequence[int]) -> Snapshot | None:
        """The snapshot whose tokens are the longest prefix of `ids` (all of them at most)."""
        self.stats.lookups += 1
        ids = tuple(ids)
        best = longest_prefix(self._snapshots, ids)
        stored = self.store.longest(ids) if self.store is not None else None
        if stored is not None and (best is None or len(stored.tokens) > len(best.tokens)):
            if (loaded := self.store.load(stored)) is not None:
                best = loaded
                self._keep(loaded)
                self.stats.disk_hits += 1
        if best is not None:
            self._snapshots.move_to_end(best.tokens)
            self.stats.hits += 1
            self.stats.restored_tokens += len(best.tokens)
        return best

    def confirm(self, snapshot: Snapshot) -> bool:
        """Whether `snapshot` stands: one read from a file is used while its digest is checked,
        and this waits for that; one that did not match leaves RAM (its file is gone already)
        and counts as no hit."""
        if snapshot.check is None or snapshot.check():
            return True
        if self._snapshots.get(snapshot.tokens) is snapshot:
            del self._snapshots[snapshot.tokens]
        self.stats.hits -= 1
        self.stats.disk_hits -= 1
        self.stats.restored_tokens -= len(snapshot.tokens)
        return False

    def add(self, tokens: Sequence[int], state: CacheState, logits: np.ndarray) -> None:
        key = tuple(tokens)
        if len(key) != state.length:
            raise UsageError(f"a snapshot of {state.length} positions given {len(key)} tokens")
        snapshot = Snapshot(key, state, np.array(logits, np.float32).reshape(-1))
        self._keep(snapshot)
        self.stats.snapshots += 1
        if self.store is not None:
            self.store.save(snapshot)

    def _keep(self, snapshot: Snapshot) -> None:
        self._snapshots[snapshot.tokens] = snapshot
        self._snapshots.move_to_end(snapshot.tokens)
        while len(self._snapshots) > self.slots:
            self._snapshots.popitem(last=False)
            self.stats.evictions += 1

    def keep(self, tokens: Sequence[int], cache: KVCache, logits: np.ndarray) -> None:
        """A snapshot of `cache` holding `tokens`, with the logits [V] after them, unless one is kept already."""
        if len(tokens) == cache.length and tokens not in self:
            self.add(tokens, cache.snapshot(), logits)

    def due(self, position: int) -> bool:
        """Whether a prefill that reached `position` takes a snapshot there (every `interval`)."""
        return self.interval > 0 and position % self.interval == 0

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk from `start` to at most `end` ends: at the next position due a snapshot if
        that comes first."""
        return min(end, (start // self.interval + 1) * self.interval) if self.interval else end

    def after_chunk(self, prompt: Sequence[int], cache: KVCache, logits: np.ndarray,
                    resumed_from: Snapshot | None) -> bool:
        """After a chunk of `prompt`'s prefill, which took `cache` to its length (the logits [V]
        after it): a snapshot there where one is due. Before it is taken, and before the logits
        after the whole prompt go out, the snapshot the prefill resumed from (None: none) must
        stand; False where it did not: the prefill starts over without it."""
        due = self.due(cache.length)
        if (due or cache.length == len(prompt)) and resumed_from is not None and not self.confirm(resumed_from):
            return False
        if due:
            self.keep(prompt[:cache.length], cache, logits)
        return True
