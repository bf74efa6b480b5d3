"""Sequences decoded together, joining and leaving between steps (continuous batching): each
step is one forward pass (MoEModel.forward_batch) over a token of every decoding sequence and,
within the step's token budget, the next prefill chunk of each sequence still prefilling —
decode tokens first, so a long prompt never stalls the others. Every sequence is sampled as
Runtime.generate samples it alone, with its own sampler, stops and cache, and with a prefix
cache resumes from its snapshots and takes new ones as generate does: a prompt starts from
the longest snapshot of all its tokens but the last (which a step then prefills, for its
logits), its chunks cut at the snapshot interval, and snapshots are taken at those positions,
at the prompt's end as its first token is sampled and at the end of its answer. With
speculation, a decoding sequence's share of a step is its last token and its drafts, verified as
Runtime.generate verifies them alone (engine/speculative.py), each sequence with its own drafter
and gate.

Shape legend: B sequences in a step, W a sequence's verified positions, V vocab.
"""
from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moerun.backends.protocol import KVCache, RecurrentStates
from moerun.engine.prefix_cache import PrefixCache
from moerun.engine.sampler import Sampler, SamplingParams
from moerun.engine.snapshot_store import Snapshot
from moerun.engine.speculative import SpecGate, SpecParams, SpecStats, keep_verified


@dataclass
class BatchStats:
    """A scheduler's: the prompts' tokens (those restored from prefix snapshots among them) and
    the seconds of the steps that only prefilled; the steps that decoded (some prefilling as well),
    their seconds and the tokens they decoded (one for each decoding sequence)."""
    prompt_tokens: int = 0
    restored_tokens: int = 0      # prompt positions taken from prefix snapshots, not prefilled
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decoded_tokens: int = 0
    decode_seconds: float = 0.0
    speculation: SpecStats | None = None     # every sequence's verifies, with speculation


@dataclass(frozen=True)
class StepEvent:
    sequence: int                 # the id add() gave
    token: int | None             # the token sampled, or None where the sequence ended without one
    finish: str | None            # why it left the batch: stop (a stop id), length (its max_new_tokens),
                                  # context (a full context), pool (a full --kv-pool: an error, as
                                  # Runtime.generate raises it); None: it goes on


@dataclass
class Running:
    """A sequence in the batch: what it was asked for, its cache, how far it is."""
    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    stop_ids: frozenset[int]
    cache: KVCache
    prefilled: int = 0                        # prompt tokens in the cache
    history: list[int] = field(default_factory=list)     # the prompt, then its tokens: what the sampler sees
    resumed_from: Snapshot | None = None      # the prefix snapshot its cache was restored from, while it prefills
    gate: SpecGate | None = None              # with speculation: its gate and drafter,
    drafter: object = None
    drafts: list[int] = field(default_factory=list)      # this step's drafts
    states: RecurrentStates = field(default_factory=RecurrentStates)   # its DeltaNet states before this verify

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)

    @property
    def tokens(self) -> list[int]:
        """The tokens sampled so far."""
        return self.history[len(self.prompt):]


class Scheduler:
    def __init__(self, model, start, copy_cache, ctx: int, budget: int, stats: BatchStats | None = None,
                 prefix_cache: PrefixCache | None = None, speculation: SpecParams = SpecParams(), drafter=None):
        """model: MoEModel; start(ids): a cache to prefill ids into and the prefix snapshot it was
        restored from (Runtime._start), copy_cache(cache): a copy of one; ctx: a sequence's most
        positions; budget: the most tokens a step takes (a decode token per sequence at least);
        prefix_cache: the snapshots start() restores, to keep new ones in; speculation and
        drafter(params): how the sequences speculate and a new sequence's drafter."""
        self.model, self.start, self.copy_cache, self.ctx, self.budget = model, start, copy_cache, ctx, budget
        self.prefix_cache = prefix_cache
        self.speculation, self.drafter = speculation, drafter
        self.running: dict[int, Running] = {}
        self.stats = stats if stats is not None else BatchStats()
        self._ids = itertools.count()

    def add(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
            stop_ids: frozenset[int] = frozenset()) -> int:
        """A sequence (a prompt of at least one token) to prefill and decode from the next step on; its id."""
        sequence_id = next(self._ids)
        cache, snapshot = self.start(prompt[:-1])
        running = Running(list(prompt), max_new_tokens, Sampler(sampling), stop_ids, cache, cache.length,
                          list(prompt), snapshot)
        if self.speculation.enabled:
            self.stats.speculation = self.stats.speculation or SpecStats()
            running.gate, running.drafter = SpecGate(self.speculation, self.stats.speculation), self.drafter(
                self.speculation)
        self.running[sequence_id] = running
        self.stats.prompt_tokens += len(prompt)
        self.stats.restored_tokens += cache.length
        return sequence_id

    def fork(self, sequence_id: int, copies: int) -> list[int]:
        """`copies` more sequences going on from where this one is (its cache, tokens and sampler's
        state copied), as llama-batched-bench's shared prompt is copied to every sequence; their ids."""
        source = self.running[sequence_id]
        ids = []
        for _ in range(copies):
            ids.append(next(self._ids))
            self.running[ids[-1]] = Running(source.prompt, source.max_new_tokens, copy.deepcopy(source.sampler),
                                            source.stop_ids, self.copy_cache(source.cache), source.prefilled,
                                            list(source.history), source.resumed_from)
        return ids

    def step(self) -> list[StepEvent]:
        """One forward pass; then every sequence whose logits it gave samples its next token (a
        verifying one: the drafts its sampler keeps, then one more)."""
        decoding = [(i, s) for i, s in self.running.items() if s.decoding]
        prefilling = [(i, s) for i, s in self.running.items() if not s.decoding]
        room = (self.budget - len(decoding)) // max(1, len(decoding))    # drafts a decoding sequence may add
        for _, s in decoding:
            self._draft(s, room)
        decode_tokens = sum(1 + len(s.drafts) for _, s in decoding)
        share = max(1, (self.budget - decode_tokens) // len(prefilling)) if prefilling else 0
        stepped = [(i, s, 0, [*s.history[-1:], *s.drafts]) for i, s in decoding]   # (id, sequence, prompt tokens, ids)
        for i, s in prefilling:
            chunk = s.prompt[s.prefilled:self._chunk_end(s.prefilled, s.prefilled + share)]
            stepped.append((i, s, len(chunk), chunk))
        started = time.perf_counter()
        logits = self.model.forward_batch([(np.asarray(ids), s.cache) for _, s, _, ids in stepped],
                                          [1 + len(s.drafts) if not prefilled else 1 for _, s, prefilled, _ in stepped])
        seconds = time.perf_counter() - started
        if decoding:
            self.stats.decode_seconds += seconds
            self.stats.decode_steps += 1
            self.stats.decoded_tokens += len(decoding)
        else:
            self.stats.prefill_seconds += seconds
        events, first = [], 0
        for i, sequence, prefilled, _ in stepped:
            rows = logits[first:first + (1 if prefilled else 1 + len(sequence.drafts))]
            first += len(rows)
            sequence.prefilled += prefilled
            if prefilled and not self._after_chunk(sequence, rows[-1]):
                self._start_over(sequence)
            elif sequence.decoding:
                events += self._verify(i, sequence, rows, seconds) if sequence.gate else [self._sample(i, sequence,
                                                                                                          rows[0])]
        return events

    def _draft(self, sequence: Running, most: int) -> None:
        """The sequence's drafts for this step, at most `most` (its share of the step's budget;
        none without speculation, or where its gate, the token limit or the context leaves no
        room), its DeltaNet states kept where it has drafts."""
        sequence.drafts, sequence.states = [], RecurrentStates()
        if sequence.gate is None:
            return
        cache, generated = sequence.cache, len(sequence.history) - len(sequence.prompt)
        room = min(most, sequence.gate.room(), sequence.max_new_tokens - generated,
                   min(self.ctx, cache.capacity) - cache.length - 1)
        drafts = sequence.drafter.draft(sequence.history, room) if room > 0 else []
        if len(drafts) >= max(1, sequence.gate.params.draft_min):
            sequence.drafts, sequence.states = drafts, cache.recurrent_states()

    def _verify(self, sequence_id: int, sequence: Running, rows: np.ndarray, seconds: float) -> list[StepEvent]:
        """A speculating sequence's tokens from its rows [W, V]: the drafts its sampler keeps, each
        taken as if drawn, then one drawn after them (unless one of them ended the sequence); its
        cache left holding all of its history but the last token, as after a plain step."""
        drafts, sampler, history = sequence.drafts, sequence.sampler, sequence.history
        start, kept = len(history) - 1, 0
        while kept < len(drafts) and sampler.accepts(rows[kept], history, drafts[kept]):
            history.append(drafts[kept])                             # what the next draft's penalties see
            kept += 1
        del history[len(history) - kept:]
        excluded = drafts[kept:kept + 1]                             # the draft rejected, if one was
        cache = sequence.cache
        keep_verified(cache, [*history, *drafts[:kept]], start, sequence.states,
                      lambda ids: self.model.forward_batch([(ids, cache)]))
        events = []
        for row in range(kept + 1):
            chosen, avoided = (drafts[row], ()) if row < kept else (None, excluded)
            events.append(self._sample(sequence_id, sequence, rows[row], chosen, avoided, held=start + 1 + row))
            if events[-1].finish is not None:
                break
        self.stats.decoded_tokens += len(events) - 1
        if drafts:
            sequence.gate.verify_step(len(drafts), kept, seconds)
        else:
            sequence.gate.plain_step(seconds)
        return events

    def _chunk_end(self, start: int, end: int) -> int:
        return self.prefix_cache.chunk_end(start, end) if self.prefix_cache is not None else end

    def _after_chunk(self, sequence: Running, logits: np.ndarray) -> bool:
        """A prefill chunk in, the logits [V] after it: a snapshot where one is due; False where the
        snapshot the sequence resumed from failed its check (Runtime._prefill's rule)."""
        if self.prefix_cache is None:
            return True
        if not self.prefix_cache.after_chunk(sequence.prompt, sequence.cache, logits, sequence.resumed_from):
            return False
        if sequence.decoding:
            sequence.resumed_from = None
        return True

    def _start_over(self, sequence: Running) -> None:
        """The sequence's prefill once more, from the longest snapshot left or none, the one it
        resumed from having failed its check (and gone)."""
        self.stats.restored_tokens -= len(sequence.resumed_from.tokens)
        sequence.cache, sequence.resumed_from = self.start(sequence.prompt[:-1])
        sequence.prefilled = sequence.cache.length
        self.stats.restored_tokens += sequence.prefilled

    def _snapshot(self, tokens: Sequence[int], sequence: Running, logits: np.ndarray) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.keep(tokens, sequence.cache, logits)

    def _sample(self, sequence_id: int, sequence: Running, logits: np.ndarray, chosen: int | None = None,
                excluded: Sequence[int] = (), held: int | None = None) -> StepEvent:
        """The sequence's next token from the logits [V] after its last position, the cache's
        `held`-th (default: its length; a verify's cache holds more); `chosen`: a draft the verify
        kept, taken as if drawn; `excluded`: drafts it rejected here. Out of the batch where it ends
        (its cache then holding `held` positions, for the answer's snapshot)."""
        token, finish, cache = None, None, sequence.cache
        held = cache.length if held is None else held
        generated = len(sequence.history) - len(sequence.prompt)
        if generated < sequence.max_new_tokens:
            token = chosen if chosen is not None else sequence.sampler(logits, sequence.history, excluded)
        if token in sequence.stop_ids:
            token, finish = None, "stop"
        if token is not None:
            sequence.history.append(token)
            generated += 1
            if generated == 1:                              # the prompt's end, as Runtime._sample takes it
                self._snapshot(sequence.prompt, sequence, logits)
        if finish is None and generated >= sequence.max_new_tokens:
            finish = "length"
        elif finish is None and held >= self.ctx:
            finish = "context"
        elif finish is None and held >= cache.capacity:
            finish = "pool"
        if finish is not None:
            del self.running[sequence_id]
            cache.truncate(held)
        if finish in ("stop", "length", "context"):          # the end of an answer, as Runtime.generate takes it
            self._snapshot(sequence.history[:cache.length], sequence, logits)
        return StepEvent(sequence_id, token, finish)

    def remove(self, sequence_id: int) -> None:
        """A sequence out of the batch before its end (its client went away); its cache goes with it."""
        self.running.pop(sequence_id, None)
