"""Speculative decoding: a drafter proposes the tokens that may come next, one forward pass
verifies them all (the last sampled token and the drafts: W = 1 + drafts positions), and the
sampler keeps the drafts it would have drawn itself (Sampler.accepts) plus one token of its own,
so the output is what plain decoding gives: the same tokens greedy, the same distribution
sampling. The cache keeps the accepted positions and drops the rest (KVCache.truncate).

Drafters: n-gram lookup (llama.cpp's `lookup`, prompt lookup decoding: the longest of the
sequence's last 1..NGRAM_MAX tokens that occurred before proposes what followed it there; with
several occurrences, their continuations as one tree), a draft model (`--model-draft`: a smaller
model of the same vocabulary, drafting greedily with a KV cache of its own that follows the
sequence), and auto's: n-gram lookup where it matches, else the draft model. The gate measures
what a verify gains (tokens per step) and costs (seconds per step, by width) against a plain
step, drafts the length that yields the most tokens a second, and pauses drafting while it loses.

Shape legend: W verified positions, V vocab.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from moerun.backends.protocol import KVCache, RecurrentStates
from moerun.errors import UsageError

SPEC_TYPES = ("none", "ngram", "draft", "auto")   # auto: ngram where it matches, else the draft model if any
NGRAM_MAX = 4
NGRAM_MIN = 1
BRANCHES_KEPT = 8            # occurrences of each n-gram the index keeps, for trees
SMOOTHING = 0.2              # the gate's moving averages: this much of each new step
FADE = 0.9                   # the acceptance counts keep this much of the past at each verify
MARGIN = 0.97                # speculation keeps running while it is at least this fast as plain steps
FIRST_PAUSE = 8              # plain steps the gate waits after a loss, doubled after each further one
LONGEST_PAUSE = 256
REMEASURE = 64               # verifies between the plain steps that keep a plain step's cost measured


@dataclass(frozen=True)
class SpecParams:
    spec_type: str = "none"
    draft_max: int = 16          # tokens a verify step checks at most (llama.cpp's --draft-max)
    draft_min: int = 0           # fewer drafted than this: a plain step instead (--draft-min)
    gated: bool = True           # False (--no-spec-gate): draft at every step, even where it loses
    draft_model: str | None = None   # --model-draft FILE: the draft model (spec types draft and auto)
    branches: int = 1            # --draft-branches: n-gram continuations a verify checks as one tree

    def __post_init__(self) -> None:
        if self.spec_type not in SPEC_TYPES:
            raise UsageError(f"--spec-type must be one of {', '.join(SPEC_TYPES)} (got {self.spec_type!r})")
        if self.spec_type == "draft" and self.draft_model is None:
            raise UsageError("--spec-type draft needs a draft model: --model-draft FILE (-md)")
        if not 1 <= self.branches <= BRANCHES_KEPT:
            raise UsageError(f"--draft-branches must be between 1 and {BRANCHES_KEPT} (got {self.branches})")
        if self.draft_max < 1 or self.draft_min < 0 or self.draft_min > self.draft_max:
            raise UsageError(f"--draft-min {self.draft_min} and --draft-max {self.draft_max}: give "
                             f"0 <= --draft-min <= --draft-max and --draft-max >= 1")

    @property
    def enabled(self) -> bool:
        return self.spec_type != "none"


class NgramDrafter:
    """Drafts from the sequence itself: for n from NGRAM_MAX down to NGRAM_MIN, the last n tokens'
    latest earlier occurrences, and the tokens that followed them. The n-grams are indexed as the
    sequence grows (each position once, the last BRANCHES_KEPT occurrences of each), so a draft
    costs a few lookups at any length."""

    def __init__(self) -> None:
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(NGRAM_MIN, NGRAM_MAX + 1)}
        self._indexed = 0          # positions whose preceding n-grams are in the index

    def draft(self, history: Sequence[int], most: int) -> list[int]:
        """Up to `most` tokens that may follow `history` (none where nothing matches)."""
        return self.tree(history, most, 1)[0]

    def tree(self, history: Sequence[int], most: int, branches: int) -> tuple[list[int], list[int]]:
        """Up to `most` drafted tokens and each one's parent (its index among them; -1: the
        sequence's end): what followed the longest matching n-gram's `branches` latest
        occurrences, as one tree whose paths share their common starts, grown a level at a time
        (the latest occurrence first) until `most` nodes."""
        for end in range(max(self._indexed, 1), len(history)):   # n-grams that something followed
            for n, ends in self._ends.items():
                if end >= n:
                    seen = ends.setdefault(tuple(history[end - n:end]), [])
                    seen[:] = [*seen[-(BRANCHES_KEPT - 1):], end]
        self._indexed = max(self._indexed, len(history))
        starts = next((self._ends[n].get(tuple(history[-n:]), []) for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1)
                       if len(history) >= n and tuple(history[-n:]) in self._ends[n]), [])
        tokens: list[int] = []
        parents: list[int] = []
        nodes: dict[tuple[int, int], int] = {}                   # (parent, token) -> node
        followed = [list(history[start:start + most]) for start in reversed(starts[-branches:])]
        tips: list[int | None] = [-1] * len(followed)            # each branch's deepest node; None: out of room
        for depth in range(most):                                # level by level, the latest branch first
            for branch, continuation in enumerate(followed):
                if tips[branch] is None or depth >= len(continuation):
                    continue
                key = (tips[branch], continuation[depth])
                if key not in nodes and len(tokens) == most:
                    tips[branch] = None
                    continue
                if key not in nodes:
                    nodes[key] = len(tokens)
                    tokens.append(continuation[depth])
                    parents.append(tips[branch])
                tips[branch] = nodes[key]
        return tokens, parents


class ModelDrafter:
    """Drafts with a draft model: its greedy tokens after the sequence. Its cache follows the
    sequence from call to call: positions past the first token where they part (a rejected
    draft) are dropped, the sequence's new tokens fed in chunks of `chunk`, then each draft but
    the last fed to give the next. A draft model with DeltaNet layers cannot drop positions
    from its states: it keeps a copy of them at the sequence's end before drafting, and the
    next call goes back there and feeds the sequence's new tokens."""

    def __init__(self, forward: Callable[[np.ndarray, KVCache], np.ndarray], cache: KVCache, chunk: int):
        self._forward, self._cache, self._chunk = forward, cache, chunk
        self._tokens: list[int] = []            # what the cache holds
        self._known = 0                         # of those, the sequence's own (it only grows)
        self._states = cache.recurrent_states()            # at position _known (DeltaNet layers only)

    def draft(self, history: Sequence[int], most: int) -> list[int]:
        same = self._known
        if self._states.conv:
            self._cache.restore_recurrent(self._states)
        else:
            while same < min(len(self._tokens), len(history)) and self._tokens[same] == history[same]:
                same += 1
        same = min(same, len(history) - 1)      # the last token fed again: its logits start the draft
        self._cache.truncate(same)
        for start in range(same, len(history), self._chunk):
            logits = self._forward(np.asarray(history[start:start + self._chunk]), self._cache)
        if self._states.conv:
            self._states = self._cache.recurrent_states()
        drafts = [int(np.argmax(logits[-1]))]
        while len(drafts) < most:
            logits = self._forward(np.array(drafts[-1:]), self._cache)
            drafts.append(int(np.argmax(logits[-1])))
        self._tokens[same:] = [*history[same:], *drafts[:-1]]
        self._known = len(history)
        return drafts


class FirstDrafter:
    """Drafts of the first drafter that has any (auto: n-gram lookup, free where the sequence
    repeats itself, then the draft model)."""

    def __init__(self, *drafters):
        self._drafters = drafters

    def draft(self, history: Sequence[int], most: int) -> list[int]:
        for drafter in self._drafters:
            drafts = drafter.draft(history, most)
            if drafts:
                return drafts
        return []


def keep_verified(cache: KVCache, tokens: Sequence[int], start: int, states: RecurrentStates,
                  feed: Callable[[np.ndarray], object]) -> None:
    """After a verify that wrote positions from `start` on: the cache holding `tokens` (the
    sequence up to its last kept token) and no more. Attention drops the positions past them;
    DeltaNet layers, whose states took every verified token in, go back to `states` (from before
    the verify) and take the kept tokens in again through feed(ids)."""
    if cache.length == len(tokens):
        return
    if not states.conv:
        cache.truncate(len(tokens))
        return
    cache.restore_recurrent(states)
    cache.truncate(start)
    feed(np.asarray(tokens[start:]))


@dataclass
class SpecStats:
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    paused_steps: int = 0        # plain steps the gate chose while speculation lost

    @property
    def mean_accepted(self) -> float:
        return self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "mean_accepted": self.mean_accepted}


@dataclass
class SpecGate:
    """Whether the next step drafts, and how many tokens, from what it measures: the seconds of
    a plain step and of verify steps by width W (moving averages), and how often a drafted
    token is accepted (alpha: accepted against rejected drafts, counts that fade by FADE a
    verify). A verify of k drafts yields 1 + alpha + ... + alpha^k tokens where each is accepted
    with alpha after the one before; the gate drafts the k (at most --draft-max) that yields the
    most tokens a second, a width not measured yet costing what the nearest measured ones say
    (linearly; past the widest, at the slope up to it). While verifies yield fewer tokens a
    second than plain steps (by MARGIN), drafting pauses for FIRST_PAUSE plain steps, twice as
    many after each further loss (at most LONGEST_PAUSE), then is measured again; a verify that
    wins resets the pause. The first step is plain (its cost measured), and one every REMEASURE
    verifies. Ungated (--no-spec-gate): --draft-max at every step."""
    params: SpecParams
    stats: SpecStats = field(default_factory=SpecStats)
    plain_seconds: float = 0.0   # per plain step
    spec_rate: float = 0.0       # tokens per second of verify steps
    pause: int = 0               # plain steps left before drafting again
    next_pause: int = FIRST_PAUSE
    accepted: float = 1.0        # faded counts of accepted and rejected drafts (a prior of one each)
    rejected: float = 1.0
    width_seconds: dict[int, float] = field(default_factory=dict)     # W -> seconds of a verify that wide
    since_plain: int = 0         # verifies since the last plain step

    def room(self) -> int:
        """Tokens the next step may draft: 0 while paused, and for a plain step to measure (the
        first, and one every REMEASURE verifies: a plain step's cost grows with the context)."""
        if not self.params.gated:
            return self.params.draft_max
        if self.pause:
            self.pause -= 1
            self.stats.paused_steps += 1
            return 0
        if not self.plain_seconds or self.since_plain >= REMEASURE:
            return 0
        return self.best_length()

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def best_length(self) -> int:
        """The drafts a verify should check for the most tokens a second (--draft-max until a
        verify is measured)."""
        if not self.plain_seconds or not self.width_seconds:
            return self.params.draft_max
        alpha = min(self.alpha, 0.999)
        rates = [(1 - alpha ** (k + 1)) / (1 - alpha) / self.cost(k + 1) for k in range(1, self.params.draft_max + 1)]
        return 1 + max(range(len(rates)), key=rates.__getitem__)

    def cost(self, width: int) -> float:
        """Seconds of a verify `width` tokens wide: measured, else along the line through the
        nearest known widths (width 1: a plain step)."""
        known = {1: self.plain_seconds, **self.width_seconds}
        if width in known:
            return known[width]
        below = max((w for w in known if w < width), default=None)
        above = min((w for w in known if w > width), default=None)
        if above is None:                                 # past the widest: its slope from the one before
            widest = max(known)
            before = max((w for w in known if w < widest), default=None)
            if before is None:
                return known[widest]
            slope = (known[widest] - known[before]) / (widest - before)
            return known[widest] + slope * (width - widest)
        if below is None:
            return known[above]
        return known[below] + (known[above] - known[below]) * (width - below) / (above - below)

    def plain_step(self, seconds: float) -> None:
        self.plain_seconds = _averaged(self.plain_seconds, seconds)
        self.since_plain = 0

    def verify_step(self, drafted: int, accepted: int, seconds: float) -> None:
        """A verify of `drafted` tokens that kept `accepted`, and gave one token more."""
        self.stats.verify_steps += 1
        self.stats.drafted_tokens += drafted
        self.stats.accepted_tokens += accepted
        self.since_plain += 1
        self.accepted = FADE * self.accepted + accepted
        self.rejected = FADE * self.rejected + (accepted < drafted)
        width = drafted + 1
        self.width_seconds[width] = _averaged(self.width_seconds.get(width, 0.0), seconds)
        self.spec_rate = _averaged(self.spec_rate, (accepted + 1) / seconds if seconds > 0 else float("inf"))
        if not self.plain_seconds:
            return
        if self.spec_rate * self.plain_seconds < MARGIN:          # fewer tokens a second than a plain step's 1
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, LONGEST_PAUSE)
            self.spec_rate = 0.0                                  # measured afresh after the pause
        else:
            self.next_pause = FIRST_PAUSE


def _averaged(average: float, value: float) -> float:
    return value if not average else (1 - SMOOTHING) * average + SMOOTHING * value
