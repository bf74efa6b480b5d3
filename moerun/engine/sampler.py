"""Token sampling: greedy, or llama.cpp's chain
penalties → top-k → top-p → min-p → temperature → draw.

The penalties look at the last `repeat_last_n` ids, as llama.cpp's do: a seen token's logit is
divided by the repetition penalty (multiplied when negative), then lowered by the presence
penalty once and by the frequency penalty for every time it was seen.

Shape legend: V vocab.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from moerun.backends.numpy_ops import softmax
from moerun.errors import UsageError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8     # 0 means greedy
    top_k: int = 40              # 0 = off
    top_p: float = 0.95          # 1.0 = off
    min_p: float = 0.05          # 0.0 = off
    repeat_penalty: float = 1.0  # 1.0 = off
    repeat_last_n: int = 64      # how many recent tokens the penalties look at
    presence_penalty: float = 0.0    # 0.0 = off
    frequency_penalty: float = 0.0   # 0.0 = off
    banned_ids: frozenset[int] = frozenset()   # never drawn (--ignore-eos: the end-of-generation ids)
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0.0, "temperature must be >= 0 (0 is greedy)"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repeat_penalty > 0.0, "repeat_penalty must be > 0"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: Sequence[int], excluded: Collection[int] = ()) -> int:
        """logits [V] of the next position; history = ids so far (prompt included). `excluded`:
        drafted tokens the verify rejected here (engine/speculative.py), drawn from the rest of
        the distribution, renormalised (greedy: none was the argmax, so nothing changes)."""
        ids, probs = self._rest(logits, history, excluded)
        if self.params.greedy:
            return int(ids[0])
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def accepts(self, logits: np.ndarray, history: Sequence[int], drafted: int,
                excluded: Collection[int] = ()) -> bool:
        """Whether the token drawn here is the drafted one: greedy, whether it is the argmax;
        sampling, with the probability the distribution, less the `excluded` drafts rejected here
        before, gives it. Speculative sampling's rule for drafts of one token each: a draw that
        tries the drafts in turn this way, then draws from what is left, keeps the distribution."""
        ids, probs = self._rest(logits, history, excluded)
        if self.params.greedy:
            return int(ids[0]) == drafted
        chance = probs[ids == drafted]
        return bool(chance.size) and self.rng.random() < float(chance[0])

    def _rest(self, logits: np.ndarray, history: Sequence[int],
              excluded: Collection[int]) -> tuple[np.ndarray, np.ndarray]:
        """candidates() less the excluded ids, renormalised (greedy: the argmax as it is)."""
        ids, probs = self.candidates(logits, history)
        if self.params.greedy or not excluded:
            return ids, probs
        keep = ~np.isin(ids, list(excluded))
        return ids[keep], probs[keep] / probs[keep].sum()

    def candidates(self, logits: np.ndarray, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The ids a draw picks from and their probabilities, as llama.cpp's chain leaves them;
        greedy: the argmax alone."""
        p = self.params
        logits = apply_penalties(logits.astype(np.float32), history[-p.repeat_last_n:] if p.repeat_last_n else [], p)
        if p.banned_ids:
            logits[list(p.banned_ids)] = -np.inf
        if p.greedy:
            return np.array([np.argmax(logits)]), np.ones(1)
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
        return ids, softmax(logits[ids] / np.float32(p.temperature))


def apply_penalties(logits: np.ndarray, recent: Sequence[int], p: SamplingParams) -> np.ndarray:
    """logits [V] with the repetition, presence and frequency penalties of the `recent` ids applied."""
    if len(recent) == 0 or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
        return logits
    seen, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    logits = logits.copy()
    values = logits[seen]
    values = np.where(values > 0, values / p.repeat_penalty, values * p.repeat_penalty)
    logits[seen] = values - np.float32(p.presence_penalty) - counts.astype(np.float32) * np.float32(p.frequency_penalty)
    return logits
