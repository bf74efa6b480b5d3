"""Runtime: one loaded model and the loops that drive it — chunked prefill, decode, logits for
every position — with their timing. It opens the backend, starts the layer shards (--split)
and the rig when daemons are asked for (they load their experts first, all at once), loads
the parent's weights (only its own layers and experts), builds the expert executor and hands
it to the model. With a prefix cache, generation, alone or batched (engine/scheduler.py),
resumes from the longest snapshot of its prompt and takes new ones (engine/prefix_cache.py);
given a Context, it goes on from tokens prefilled before (the depth of `moerun bench -d`).

Shape legend: T prompt tokens, V vocab.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from moerun.backends import open_backend
from moerun.backends.kv_types import KVTypes
from moerun.backends.protocol import CacheState, KVCache
from moerun.engine.model import MoEModel
from moerun.engine.prefix_cache import PrefixCache
from moerun.engine.sampler import Sampler, SamplingParams
from moerun.engine.scheduler import BatchStats, Scheduler
from moerun.engine.snapshot_store import Snapshot
from moerun.engine.speculative import (
    FirstDrafter,
    ModelDrafter,
    NgramDrafter,
    SpecGate,
    SpecParams,
    SpecStats,
    keep_verified,
)
from moerun.engine.weights import load_weights
from moerun.errors import MoerunError
from moerun.gguf.reader import GGUFError, GGUFFile
from moerun.gguf.tokenizer import Tokenizer, TokenizerError
from moerun.models import load_spec
from moerun.moe.context import ContextRoom, choose_context
from moerun.moe.executor import LocalExecutor, MoEStats
from moerun.moe.hotness import RoutingCounter
from moerun.moe.placement import PARENT
from moerun.moe.planner import kv_values_per_token
from moerun.rig.cores import HostShares, share_host
from moerun.rig.settings import ConfigError, RigConfig
from moerun.rig.shards import LayerShards, auto_splits
from moerun.rig.supervisor import Rig

DEFAULT_CONTEXT = 4096
DEFAULT_UBATCH = 512
DEFAULT_EXPERT_CACHE_BYTES = 4 << 30
SHORT_REST_STEPS = 4    # a prompt's rest of up to this many captured steps goes in them rather than in one
                        # eager pass, whose launches cost ten times a replayed step's time (docs/gpu.md)

logger = logging.getLogger(__name__)


class RequestError(MoerunError):
    """A request the loaded model cannot serve (prompt too long, bad token id, ...)."""


@dataclass
class RunStats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    decode_steps: int = 0        # forward passes after the prompt (a speculative verify is one)
    decode_tokens: int = 0       # the tokens whose distributions they gave (= decode_steps without speculation)
    decode_seconds: float = 0.0
    finish: str = ""             # why generation ended: stop (a stop token), length (max tokens), context (full)
    restored_tokens: int = 0     # prompt positions taken from a prefix snapshot, not prefilled
    speculation: SpecStats | None = None     # with --spec-type: its verify steps, drafts and acceptance

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "prefill_tokens_per_second": self.prefill_tokens_per_second,
                "decode_tokens_per_second": self.decode_tokens_per_second,
                "speculation": self.speculation.to_dict() if self.speculation is not None else None}


@dataclass(frozen=True)
class Context:
    """Tokens a sequence holds already, for generate() to go on from: their KV cache's state,
    restored into a fresh cache each time; None where layer shards hold part of that cache
    (theirs keep no snapshots), and the tokens are then prefilled again each time."""
    tokens: tuple[int, ...]
    state: CacheState | None


class Runtime:
    def __init__(self, path: str | Path, *, ctx: int | None = None, kv_pool: int | None = None,
                 ubatch: int = DEFAULT_UBATCH, expert_cache_bytes: int = DEFAULT_EXPERT_CACHE_BYTES,
                 rig: RigConfig = RigConfig(), count_routing: bool = False, prefix_cache: PrefixCache | None = None,
                 draft_model: str | Path | None = None):
        """count_routing: count how often each expert is routed to (routing_counts());
        prefix_cache: where generate() resumes from and keeps snapshots; draft_model: a model of
        the same vocabulary that drafts for speculative decoding, on the parent's device."""
        if ubatch < 1:
            raise RequestError(f"--ubatch must be at least 1 (got {ubatch})")
        self.gguf = GGUFFile(path)
        self.rig: Rig | None = None
        self.draft: Runtime | None = None                # --model-draft
        self.shards: LayerShards | None = None           # the layers after the parent's (--split)
        self.cpus: HostShares | None = None
        self._tokenizer: Tokenizer | None = None
        self.ubatch = ubatch
        self.prefix_cache = prefix_cache
        try:
            self.spec = load_spec(self.gguf)
            if ctx and ctx > self.spec.context_train:
                logger.warning(f"--ctx {ctx} is beyond the {self.spec.context_train} positions the model was "
                               f"trained on: past them its output may degrade")
            fixed = ctx or min(self.spec.context_train, DEFAULT_CONTEXT)     # before the weights are in
            if (rig.splits or rig.split_auto) and prefix_cache is not None:
                raise ConfigError("--split: prefix snapshots do not reach the layer shards' KV caches yet; run "
                                  "without --prefix-cache-slots (0) or without --split")
            self.cpus = share_host(rig)         # the parent's CPU threads, and those of this host's CPU daemons
            self.cpus.apply_to_parent()
            self.backend = open_backend(rig.device, self.spec, graphs=rig.graphs, threads=self.cpus.parent.threads,
                                        kv_types=rig.kv_cache_types)
            positions = min(kv_pool or fixed, fixed)   # what the rig's plan and the layer shards reserve
            if rig.split_auto:
                rig = dataclasses.replace(rig, splits=auto_splits(self.gguf, self.spec, rig, positions),
                                          split_auto=False)
            if rig.splits:
                self.shards = LayerShards(rig, self.gguf.path, self.gguf.fingerprint(), self.spec, positions, ubatch,
                                          self.backend)
            layers = range(self.shards.first_layer) if self.shards else None
            if rig.daemons:
                self.rig = Rig(rig, self.gguf, self.spec, self.backend, kv_tokens=positions, cpus=self.cpus,
                               layers=layers)
            held = self.rig.placement.experts_of(PARENT) if self.rig else None
            weights = load_weights(self.gguf, self.spec, self.backend, held, expert_cache_bytes, layers=layers)
            executor = (self.rig.executor(weights.experts, expert_cache_bytes) if self.rig
                        else LocalExecutor(weights.experts))
            routing = RoutingCounter(self.spec) if count_routing else None
            self.model = MoEModel(self.spec, self.backend, weights, executor, routing, self.shards)
            self.ctx = fixed if self.shards else self._fitted_context(ctx, kv_pool, rig.kv_cache_types)
            self.kv_pool = kv_pool if kv_pool is not None and kv_pool < self.ctx else None
            self.backend.new_cache(self.kv_pool or self.ctx)       # a GPU's: allocated now, reused per sequence
            if prefix_cache is not None:
                prefix_cache.open_store(self.gguf.fingerprint(), f"{self.backend.kind}:{self.backend.kv_types.label}")
            if draft_model is not None:
                self.draft = self._open_draft(draft_model, rig)
        except BaseException:
            self.close()
            raise

    def _fitted_context(self, ctx: int | None, kv_pool: int | None, kv_types: KVTypes) -> int:
        """--ctx, or the model's context where it fits beside the weights, else the most that fits
        (moe/context.py); one line says so where it cut the model's or warns."""
        free, work = self.backend.context_memory(self.ubatch)
        room = ContextRoom(free, kv_types.token_bytes(*kv_values_per_token(self.spec)), work, kv_types.label,
                           self.backend.cache_grows)
        chosen, line = choose_context(self.spec.context_train, ctx, kv_pool, room)
        if line:
            logger.warning(line)
        return chosen

    @property
    def device(self) -> str:
        """The parent's device: cpu, cuda:N or hip:N."""
        return self.backend.name

    @property
    def tokenizer(self) -> Tokenizer:
        """Built on first use, so `logits --ids` works on files without a vocabulary."""
        if self._tokenizer is None:
            try:
                self._tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
            except TokenizerError as err:
                raise GGUFError(self.gguf.path, str(err)) from None
        return self._tokenizer

    def moe_stats(self) -> MoEStats:
        """MoE layer calls and routed pairs so far, and how many left the parent (may wait for
        the device)."""
        return self.model.moe_stats()

    def routing_counts(self) -> np.ndarray:
        """int64 [L, E]: how often each expert was routed to (a Runtime made with count_routing)."""
        return self.model.routing.counts

    def _open_draft(self, path: str | Path, rig: RigConfig) -> Runtime:
        """The draft model, all on the parent's device with the parent's threads and KV types, its
        context the target's; refused unless its vocabulary is the target's, token for token."""
        draft = Runtime(path, ctx=self.ctx, ubatch=self.ubatch,
                        rig=RigConfig(device=rig.device, graphs=rig.graphs, threads=rig.threads, kv_dtype=rig.kv_dtype,
                                      cache_type_k=rig.cache_type_k, cache_type_v=rig.cache_type_v))
        tokens, draft_tokens = (runtime.gguf.metadata.get("tokenizer.ggml.tokens") for runtime in (self, draft))
        if draft.spec.vocab != self.spec.vocab or tokens != draft_tokens:
            draft.close()
            raise RequestError(f"--model-draft {path}: its vocabulary ({draft.spec.vocab} tokens) is not the "
                               f"model's ({self.spec.vocab}): a draft model must share the target's tokenizer")
        return draft

    def close(self) -> None:
        """Stop the daemons this runtime spawned, finish writing snapshots, release the model file."""
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        if self.prefix_cache is not None:
            self.prefix_cache.close()
        if self.rig is not None:
            self.rig.close()
            self.rig = None
        if self.shards is not None:
            self.shards.close()
            self.shards = None
        if self.cpus is not None:
            self.cpus.release()
        self.gguf.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def logits(self, ids: Sequence[int], stats: RunStats | None = None) -> np.ndarray:
        """Float32 logits [T, V] for every position of a fresh sequence, prefilled
        in chunks of `ubatch` tokens exactly as generation does."""
        self._check_prompt(ids)
        cache = self._new_cache()
        started = time.perf_counter()
        chunks = [self.model.forward(chunk, cache, all_logits=True) for chunk in self._chunks(ids, 0)]
        if stats is not None:
            stats.prompt_tokens, stats.prefill_seconds = len(ids), time.perf_counter() - started
        return np.concatenate(chunks, axis=0).astype(np.float32)

    def context(self, ids: Sequence[int]) -> Context:
        """`ids` prefilled into a fresh sequence, for generate(context=...) to go on from."""
        cache = self._prefilled(ids)
        return Context(tuple(ids), None if self.shards is not None else cache.snapshot())

    def generate(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                 stop_ids: frozenset[int] = frozenset(), stats: RunStats | None = None,
                 context: Context | None = None, speculation: SpecParams = SpecParams()) -> Iterator[int]:
        """Yield up to max_new_tokens sampled ids; a stop id ends generation and is
        not yielded. Stops early, without error, when the context is full; stats.finish says
        which of the three ended it. Time spent by the caller between tokens is not counted
        in `stats`. With `context`, the prompt goes on from its tokens (at least one token of
        it), which were prefilled before: their cache is restored before the prefill's clock starts.
        With `speculation` enabled, decode verifies drafted tokens (engine/speculative.py): the same
        tokens greedy, the same distribution sampling."""
        stats = stats if stats is not None else RunStats()
        sampler = Sampler(sampling)
        gate = self._gate(speculation, stats)
        if context is not None and not prompt:
            raise RequestError("nothing to go on with after the context: give at least one token")
        history = [*context.tokens, *prompt] if context is not None else list(prompt)
        resumed = self._resume(context) if context is not None else None

        started = time.perf_counter()
        cache, logits = self._prefill(history, stats, resumed)
        stats.prompt_tokens = len(history)
        stats.prefill_seconds = time.perf_counter() - started

        stats.finish = "length"
        logits = yield from self._sample(cache, logits, sampler, history, max_new_tokens, stop_ids, stats, gate)
        self._snapshot(history[:cache.length], cache, logits)      # the end of an answer: a chat's next turn

    def _drafter(self, params: SpecParams) -> NgramDrafter | ModelDrafter | FirstDrafter:
        """The sequence's drafter: n-gram lookup (ngram, and auto without a draft model), the draft
        model's (draft), or auto with one: n-gram lookup where it matches, else the draft model."""
        if self.draft is None or params.spec_type == "ngram":
            return NgramDrafter()
        model = self.draft.model
        drafter = ModelDrafter(lambda ids, cache: model.forward(ids, cache, all_logits=False),
                               self.draft._new_cache(), self.ubatch)
        return drafter if params.spec_type == "draft" else FirstDrafter(NgramDrafter(), drafter)

    def _gate(self, speculation: SpecParams, stats: RunStats) -> SpecGate | None:
        """The speculation gate of a sequence, counting into stats.speculation; None when off."""
        if not speculation.enabled:
            return None
        self._check_speculation(speculation)
        stats.speculation = stats.speculation or SpecStats()        # a chat's turns add up
        return SpecGate(speculation, stats.speculation)

    def _check_speculation(self, speculation: SpecParams) -> None:
        """Refused: a draft spec type without a draft model, and where a verify's rejected positions
        cannot be dropped yet: layer shards of a hybrid model (theirs go back with the next step's
        start, daemons/shard.py, but not their DeltaNet states)."""
        if speculation.spec_type == "draft" and self.draft is None:
            raise RequestError("--spec-type draft: this runtime has no draft model (--model-draft FILE)")
        if self.shards is not None and self.spec.delta_net is not None:
            raise RequestError(f"--spec-type {speculation.spec_type}: layer shards of a model with DeltaNet layers "
                               f"cannot roll a rejected draft back yet; give --spec-type none, or run without --split")

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                       sampling: Sequence[SamplingParams], stop_ids: frozenset[int] = frozenset(),
                       stats: BatchStats | None = None, speculation: SpecParams = SpecParams()) -> list[list[int]]:
        """Several sequences decoded together (engine/scheduler.py), each sampled, resumed from
        prefix snapshots and snapshotted as generate() does it alone; returns each one's tokens.
        On the CPU parent, without layer shards (for now)."""
        if not len(prompts) == len(max_new_tokens) == len(sampling):
            raise RequestError("generate_batch: one max_new_tokens and one sampling per prompt")
        scheduler = self.scheduler(stats, speculation)
        for prompt, most, params in zip(prompts, max_new_tokens, sampling):
            self._check_prompt(prompt)
            scheduler.add(prompt, most, params, stop_ids)
        tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        while scheduler.running:
            for event in scheduler.step():
                if event.token is not None:
                    tokens[event.sequence].append(event.token)
                if event.finish == "pool":
                    raise RequestError(self.pool_full(self.kv_pool + 1))
        return [tokens[i] for i in range(len(prompts))]

    def scheduler(self, stats: BatchStats | None = None, speculation: SpecParams = SpecParams()) -> Scheduler:
        """A batch of sequences this runtime decodes together, each step within ubatch tokens,
        each sequence resuming from and keeping the runtime's prefix snapshots, speculating as
        `speculation` says (each with its own drafter and gate)."""
        capacity = self.kv_pool or self.ctx
        if speculation.enabled:
            self._check_speculation(speculation)
        return Scheduler(self.model, self._start,
                         lambda cache: self.backend.restore_cache(cache.snapshot(), capacity), self.ctx, self.ubatch,
                         stats, self.prefix_cache, speculation, self._drafter)

    def _sample(self, cache: KVCache, logits: np.ndarray, sampler: Sampler, history: list[int], max_new_tokens: int,
                stop_ids: frozenset[int], stats: RunStats, gate: SpecGate | None) -> Iterator[int]:
        """generate()'s tokens after the prompt; returns the last logits computed. Each pass
        leaves the cache holding `history` and `logits` [1, V] the distribution after it. With a
        gate, a pass verifies the drafter's tokens after the one sampled (engine/speculative.py),
        a chain or, with --draft-branches, a tree: from each position the sampler tries the drafts
        that follow it in turn, each it accepts counts as drawn, and the cache keeps the positions
        of the path taken."""
        drafter = self._drafter(gate.params) if gate is not None else None
        trees = gate is not None and gate.params.branches > 1 and isinstance(drafter, NgramDrafter) and self._trees
        excluded: set[int] = set()                      # drafts rejected at this position
        produced = 0
        while produced < max_new_tokens:
            token = sampler(logits[-1], history, excluded)
            if token in stop_ids:
                stats.finish = "stop"
                return logits
            produced += 1
            stats.generated_tokens += 1
            yield token
            if produced == 1:            # the prompt's end, taken after its first token is out
                self._snapshot(history, cache, logits)
            history.append(token)
            if produced == max_new_tokens:
                return logits
            if cache.length >= self.ctx:
                stats.finish = "context"
                return logits
            if cache.length >= cache.capacity:
                raise RequestError(self.pool_full(cache.length + 1))
            room = min(gate.room(), max_new_tokens - produced,
                       min(self.ctx, cache.capacity) - cache.length - 1) if gate is not None else 0
            started = time.perf_counter()
            drafts, parents = ((drafter.tree(history, room, gate.params.branches) if trees else
                                (drafter.draft(history, room), None)) if room > 0 else ([], None))
            if not drafts or len(drafts) < gate.params.draft_min:
                logits, excluded = self._decode(token, cache, stats, gate), set()
                continue
            in_line = list(range(-1, len(drafts) - 1))                  # a chain's parents
            chain = parents is None or parents == in_line
            parents = in_line if chain else parents
            start, states = cache.length, cache.recurrent_states()
            ids = np.array([token, *drafts])
            rows = (self.model.forward(ids, cache, all_logits=True) if chain
                    else self.model.forward_tree(ids, parents, cache))                         # [W, V]
            path, excluded = [], set()
            while produced < max_new_tokens and stats.finish != "stop":
                node = path[-1] if path else -1
                taken = _accepted_child(sampler, rows[node + 1], history, drafts, parents, node, excluded)
                if taken is None:
                    break
                if drafts[taken] in stop_ids:
                    stats.finish = "stop"
                    break
                excluded = set()
                path.append(taken)
                produced += 1
                stats.generated_tokens += 1
                yield drafts[taken]
                history.append(drafts[taken])
            if chain:
                keep_verified(cache, history, start, states,
                              lambda ids: self.model.forward(ids, cache, all_logits=False))
            else:
                cache.keep_rows(start, [start, *(start + 1 + node for node in path)])
            logits = rows[path[-1] + 1 if path else 0][None]
            self._count_verify(stats, gate, len(drafts), len(path), time.perf_counter() - started,
                               produced < max_new_tokens)
            if stats.finish == "stop":
                return logits
        return logits

    @property
    def _trees(self) -> bool:
        """Whether verifies may be trees here: a CPU parent, attention-only, without layer shards."""
        return self.backend.kind == "CPU" and self.spec.delta_net is None and self.shards is None

    def _prefill(self, prompt: Sequence[int], stats: RunStats,
                 resumed: KVCache | None = None) -> tuple[KVCache, np.ndarray]:
        """The prompt's cache and the logits [1, V] after it: from `resumed` (a context's
        cache, holding the prompt's first positions), else from the longest snapshot of its
        prefix where there is one, the rest in chunks, snapshots taken every `interval`
        positions (the prompt's end waits for its first token: _sample). A snapshot read from
        a file is used while its digest is checked; before any snapshot is taken from it, and
        before the logits go out, the check must have passed, else the prompt starts over
        without that snapshot."""
        self._check_prompt(prompt)
        cache, snapshot = (resumed, None) if resumed is not None else self._start(prompt)
        logits = snapshot.logits[None] if snapshot is not None else None
        stats.restored_tokens = cache.length
        for chunk in self._chunks(prompt, cache.length):
            logits = self.model.forward(chunk, cache, all_logits=False)
            stands = self.prefix_cache is None or self.prefix_cache.after_chunk(prompt, cache, logits[-1], snapshot)
            if not stands:
                return self._prefill_again(prompt, stats)
        whole = snapshot is not None and len(snapshot.tokens) == len(prompt)    # no chunk ran to check it
        if whole and not self.prefix_cache.confirm(snapshot):
            return self._prefill_again(prompt, stats)
        return cache, logits

    def _start(self, ids: Sequence[int]) -> tuple[KVCache, Snapshot | None]:
        """A cache to prefill `ids` into, and the snapshot it was restored from: the longest
        snapshot of their prefix (all of them at most) where the prefix cache has one, else a
        fresh cache and None."""
        snapshot = self.prefix_cache.longest(ids) if self.prefix_cache is not None else None
        if snapshot is None:
            return self._new_cache(), None
        return self.backend.restore_cache(snapshot.state, self.kv_pool or self.ctx), snapshot

    def _prefill_again(self, prompt: Sequence[int], stats: RunStats) -> tuple[KVCache, np.ndarray]:
        """The prompt once more, its snapshot having failed its check (and gone)."""
        stats.restored_tokens = 0
        return self._prefill(prompt, stats)

    def _prefilled(self, ids: Sequence[int]) -> KVCache:
        """A fresh sequence's cache holding `ids`."""
        self._check_prompt(ids)
        cache = self._new_cache()
        for chunk in self._chunks(ids, 0):
            self.model.forward(chunk, cache, all_logits=False)
        return cache

    def _resume(self, context: Context) -> KVCache:
        """A fresh cache holding the context's tokens: their state restored, or (layer shards) prefilled."""
        if context.state is None:
            return self._prefilled(context.tokens)
        return self.backend.restore_cache(context.state, self.kv_pool or self.ctx)

    def _new_cache(self) -> KVCache:
        """A fresh sequence's cache; the layer shards start one too (restarting a broken shard)."""
        if self.shards is not None:
            self.shards.begin_sequence()
        return self.backend.new_cache(self.kv_pool or self.ctx)

    def _snapshot(self, tokens: Sequence[int], cache: KVCache, logits: np.ndarray) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.keep(tokens, cache, logits[-1])        # forward() gives host logits

    def _decode(self, token: int, cache: KVCache, stats: RunStats, gate: SpecGate | None = None) -> np.ndarray:
        """One decode step: the token's forward pass, timed -> logits [1, V]."""
        started = time.perf_counter()
        logits = self.model.forward(np.array([token]), cache, all_logits=False)
        seconds = time.perf_counter() - started
        stats.decode_seconds += seconds
        stats.decode_steps += 1
        stats.decode_tokens += 1
        if gate is not None:
            gate.plain_step(seconds)
        return logits

    @staticmethod
    def _count_verify(stats: RunStats, gate: SpecGate, drafted: int, taken: int, seconds: float,
                      goes_on: bool) -> None:
        """A verify pass: its drafts, those taken, and (where generation goes on) the distribution
        after them: one token more."""
        stats.decode_seconds += seconds
        stats.decode_steps += 1
        stats.decode_tokens += taken + goes_on
        gate.verify_step(drafted, taken, seconds)

    def _check_prompt(self, ids: Sequence[int]) -> None:
        if len(ids) == 0:
            raise RequestError("the prompt is empty: give at least one token")
        if len(ids) > self.ctx:
            raise RequestError(f"the prompt has {len(ids)} tokens but the context is {self.ctx}; raise --ctx")
        if self.kv_pool is not None and len(ids) > self.kv_pool:
            raise RequestError(self.pool_full(len(ids)))
        bad = [i for i in ids if not 0 <= i < self.spec.vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.spec.vocab - 1})")

    def pool_full(self, needed: int) -> str:
        """What a sequence that outgrows --kv-pool is told."""
        return (f"the sequence needs {needed} KV positions but the KV pool holds {self.kv_pool} "
                f"(--kv-pool); raise --kv-pool, or drop it to reserve the whole --ctx {self.ctx}")

    def _chunks(self, ids: Sequence[int], start: int) -> Iterator[np.ndarray]:
        """ids[start:] in chunks of at most `ubatch`, cut at the prefix cache's snapshot interval;
        a short rest (a chat's next turn after its snapshot, say) in the steps the model replays
        captured, where it has them: a few replays cost less than one eager pass of many launches."""
        array = np.asarray(ids, dtype=np.int64)
        step = self.model.step_tokens
        while start < len(array):
            rest = len(array) - start
            size = min(step, self.ubatch) if 0 < step < rest <= SHORT_REST_STEPS * step else self.ubatch
            end = min(len(array), start + size)
            if self.prefix_cache is not None:
                end = self.prefix_cache.chunk_end(start, end)
            yield array[start:end]
            start = end


def _accepted_child(sampler: Sampler, logits: np.ndarray, history: list[int], drafts: list[int], parents: list[int],
                    node: int, excluded: set[int]) -> int | None:
    """The first child of `node` (-1: the sampled token) whose draft the sampler takes at the
    distribution `logits` [V] after it, trying them in turn and adding each one it rejects to
    `excluded`; None where it takes none."""
    for child, parent in enumerate(parents):
        if parent != node:
            continue
        if sampler.accepts(logits, history, drafts[child], excluded):
            return child
        excluded.add(drafts[child])
    return None
