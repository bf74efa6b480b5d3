"""Token sampling: greedy, or llama.cpp's chain
repetition penalty → top-k → top-p → min-p → temperature → draw.

Shape legend: V vocab.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moerun.backends.numpy_ops import softmax


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8     # 0 means greedy
    top_k: int = 40              # 0 = off
    top_p: float = 0.95          # 1.0 = off
    min_p: float = 0.05          # 0.0 = off
    repeat_penalty: float = 1.0  # 1.0 = off
    repeat_last_n: int = 64      # how many recent tokens the penalty looks at
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0.0, "temperature must be >= 0 (0 is greedy)"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repeat_penalty > 0.0, "repeat_penalty must be > 0"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """logits [V] of the next position; history = ids so far (prompt included)."""
        p = self.params
        logits = _penalize_repeats(logits.astype(np.float32), history[-p.repeat_last_n:] if p.repeat_last_n else [],
                                   p.repeat_penalty)
        if p.greedy:
            return int(np.argmax(logits))
        ids = np.argsort(-logits, kind="stable")                  # candidates, best first
        if p.top_k:
            ids = ids[: p.top_k]
        probs = softmax(logits[ids])
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            ids, probs = ids[:keep], probs[:keep]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            ids = ids[keep]
        probs = softmax(logits[ids] / np.float32(p.temperature))
        return int(ids[self.rng.choice(len(ids), p=probs)])


def _penalize_repeats(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    """Divide positive logits of recently seen tokens by `penalty`, multiply negative ones."""
    if penalty == 1.0 or len(recent) == 0:
        return logits
    seen = np.unique(np.asarray(recent, dtype=np.int64))
    logits = logits.copy()
    values = logits[seen]
    logits[seen] = np.where(values > 0, values / penalty, values * penalty)
    return logits
