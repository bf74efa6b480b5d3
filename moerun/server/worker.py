"""The single worker that owns the Runtime and serves queued requests: one at a time, or with
`parallel` slots up to that many decoded together (the runtime's scheduler: continuous batching,
a request joining as a slot frees; on the CPU parent without layer shards). Either way a request
resumes from the longest prefix snapshot of its prompt and leaves new ones (engine/prefix_cache.py).

The runtime is synchronous, so one thread loads the model, then takes jobs from a
first-in first-out queue and generates them, handing their text to the waiting async
handlers through each handler's event loop. A job whose client has gone stops between two
tokens (its sequence leaves the batch); a job cancelled while it waits is skipped.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import astuple, dataclass
from typing import Any

from moerun.engine.runtime import RequestError, RunStats, Runtime
from moerun.engine.scheduler import Scheduler
from moerun.engine.speculative import SpecParams, SpecStats
from moerun.gguf.chat import ChatTemplateError, render_messages
from moerun.gguf.tokenizer import TokenizerError, TooManyTokens
from moerun.rig.shards import ShardFailed
from moerun.server.metrics import ServerMetrics
from moerun.server.schemas import ApiError, Generation
from moerun.server.stops import StopMatcher

logger = logging.getLogger(__name__)
QUEUE_RETRY_AFTER_S = 1        # what a request refused for a full queue is told to wait


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int | None = None   # None: the context less one token
    max_tokens: int | None = None          # None: whatever the context leaves after the prompt
    max_queue: int = 256                   # requests waiting, beyond those generating
    parallel: int = 1                      # requests decoded together (llama-server's -np)


@dataclass(frozen=True)
class Piece:
    text: str


@dataclass(frozen=True)
class Finished:
    reason: str                            # "stop" (end of sequence or stop sequence),
                                           # "length" (max_tokens or a full context)
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    error: ApiError


class Job:
    """One request: its prompt and options, and the way back to the handler that waits for it."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, generation: Generation):
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.generation = generation
        self.arrived = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Piece | Finished | Failed] = asyncio.Queue()
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """The client is gone: stop at the next token, or skip the job if it has not started."""
        self._cancelled.set()

    def send(self, event: Piece | Finished | Failed) -> None:
        """From the worker thread: queue an event for the handler."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:           # the event loop has closed: nobody is listening
            self.cancel()

    async def events(self) -> AsyncIterator[Piece | Finished | Failed]:
        """Pieces of text, then one Finished or Failed."""
        while True:
            event = await self._events.get()
            yield event
            if not isinstance(event, Piece):
                return


@dataclass
class Slot:
    """A job decoding in the scheduler: its text decoder, stop matcher and tokens so far."""
    job: Job
    decoder: Any
    stops: StopMatcher
    tokens: int = 0
    first_token_at: float = 0.0


class Worker:
    def __init__(self, open_runtime: Callable[[], Runtime], limits: Limits = Limits(),
                 metrics: ServerMetrics | None = None, on_load_failure: Callable[[], None] = lambda: None,
                 on_ready: Callable[[], None] = lambda: None, speculation: SpecParams = SpecParams()):
        """`on_ready` and `on_load_failure` are called from the worker's thread once loading ends;
        `speculation`: how each request alone decodes (engine/speculative.py)."""
        self.limits = limits
        self.speculation = speculation
        self._spec_counted = SpecStats()       # the batch's speculation counters, as far as /metrics has them
        self.metrics = metrics or ServerMetrics()
        self.runtime: Runtime | None = None
        self.load_error: str | None = None
        self._open_runtime = open_runtime
        self._on_load_failure = on_load_failure
        self._on_ready = on_ready
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._current: Job | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="moerun-worker", daemon=True)

    @property
    def ready(self) -> bool:
        return self.runtime is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Cancel what runs and waits, then close the runtime (and its daemons)."""
        self._stopping = True
        if self._current is not None:
            self._current.cancel()
        self._jobs.put(None)
        self._thread.join(timeout_s)

    @property
    def context(self) -> int:
        """Tokens one sequence may hold: the KV pool when there is one, else the context."""
        runtime = self._loaded()
        return runtime.kv_pool or runtime.ctx

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, as `moerun run --chat` does.
        This and text_prompt take long on big prompts: call them off the event loop."""
        try:
            text = render_messages(self._loaded().tokenizer, messages)
        except ChatTemplateError as err:
            raise ApiError(400, str(err), param="messages") from None
        return self._tokens(text, "messages")

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._tokens(prompt, "prompt")
        self._check_length(len(prompt), "prompt")
        vocab = self._loaded().spec.vocab
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        return prompt

    def submit(self, prompt_ids: list[int], generation: Generation) -> Job:
        """Queue a request behind those already waiting; call from the handler's event loop."""
        room = self.context - len(prompt_ids)
        max_tokens = generation.max_tokens
        if max_tokens is not None and self.limits.max_tokens is not None and max_tokens > self.limits.max_tokens:
            raise ApiError(400, f"max_tokens is {max_tokens}, more than the {self.limits.max_tokens} this server "
                                "allows", param="max_tokens", code="invalid_value")
        if max_tokens is None:
            max_tokens = min(room, self.limits.max_tokens or room)
        elif max_tokens > room:
            raise ApiError(400, f"the context holds {self.context} tokens: the prompt takes {len(prompt_ids)}, "
                                f"which leaves {room}, but max_tokens is {max_tokens}",
                           param="max_tokens", code="context_length_exceeded")
        if self._jobs.qsize() >= self.limits.max_queue:
            raise ApiError(503, f"{self.limits.max_queue} requests are waiting already; try again later",
                           type="server_busy_error", code="queue_full", retry_after_s=QUEUE_RETRY_AFTER_S)
        job = Job(prompt_ids, max_tokens, generation)
        self.metrics.queued.inc()
        self._jobs.put(job)
        return job

    def _loaded(self) -> Runtime:
        if self.runtime is None:
            message = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise ApiError(503, message, type="server_error", code="model_not_ready")
        return self.runtime

    def _tokens(self, text: str, param: str) -> list[int]:
        """The text's ids; a text over the prompt limit is refused by its count, its ids never listed."""
        try:
            ids = self._loaded().tokenizer.encode(text, max_tokens=self._prompt_limit())
        except TooManyTokens as err:
            raise self._too_long(err.count, param) from None
        except TokenizerError as err:
            raise ApiError(400, str(err), param=param) from None
        self._check_length(len(ids), param)
        return ids

    def _prompt_limit(self) -> int:
        return min(self.limits.max_prompt_tokens or self.context, self.context - 1)

    def _check_length(self, count: int, param: str) -> None:
        if count == 0:
            raise ApiError(400, "the prompt is empty", param=param)
        if count > self._prompt_limit():
            raise self._too_long(count, param)

    def _too_long(self, count: int, param: str) -> ApiError:
        return ApiError(400, f"the prompt has {count} tokens; this server accepts at most {self._prompt_limit()} "
                             f"(context {self.context} tokens)", param=param, code="context_length_exceeded")

    def _work(self) -> None:
        try:
            runtime = self._open_runtime()
            runtime.tokenizer                  # built here, before handlers read it from other threads
        except Exception as err:  # noqa: BLE001 - the server stays up and answers every request with it
            self.load_error = str(err)
            logger.error(f"the model failed to load: {err}")
            self._on_load_failure()
            return
        self.metrics.watch(runtime)
        self.runtime = runtime
        try:
            self._on_ready()
            if self.limits.parallel > 1:
                self._serve_together(runtime)
            else:
                while (job := self._jobs.get()) is not None:
                    self.metrics.queued.dec()
                    self._serve(job)
        finally:
            runtime.close()

    def _serve_together(self, runtime: Runtime) -> None:
        """Up to `parallel` jobs in the runtime's scheduler, admitted as slots free (waiting for
        one only while none runs), one batched step at a time, each step's tokens streamed to
        their jobs. A failed step fails the jobs in it; the server goes on."""
        scheduler = runtime.scheduler(speculation=self.speculation)
        self._spec_counted = SpecStats()
        slots: dict[int, Slot] = {}
        while True:
            if self._stopping:
                for slot in slots.values():
                    self._close_slot(slot, "cancelled")
                return
            while len(slots) < self.limits.parallel:
                try:
                    job = self._jobs.get(block=not slots)
                except queue.Empty:
                    break
                if job is None:
                    for slot in slots.values():
                        self._close_slot(slot, "cancelled")
                    return
                self.metrics.queued.dec()
                if job.cancelled or self._stopping:
                    self.metrics.requests.labels("cancelled").inc()
                    continue
                sequence = scheduler.add(job.prompt_ids, job.max_tokens, job.generation.sampling,
                                         runtime.tokenizer.stop_ids)
                slots[sequence] = Slot(job, runtime.tokenizer.stream_decoder(skip_special=True),
                                       StopMatcher(job.generation.stop))
                self.metrics.running.inc()
            for sequence, slot in list(slots.items()):
                if slot.job.cancelled:
                    scheduler.remove(sequence)
                    self._close_slot(slots.pop(sequence), "cancelled")
            if slots:
                self._step_together(scheduler, slots)

    def _step_together(self, scheduler: Scheduler, slots: dict[int, Slot]) -> None:
        self.metrics.batch_sequences.observe(len(slots))
        try:
            events = scheduler.step()
        except Exception as err:  # noqa: BLE001 - a bug or a bad request fails the step's jobs, logged
            if not isinstance(err, RequestError):
                logger.error(f"a batched step failed:\n{traceback.format_exc()}")
            for sequence in list(slots):
                scheduler.remove(sequence)
                slot = slots.pop(sequence)
                slot.job.send(Failed(ApiError(400 if isinstance(err, RequestError) else 500, str(err))))
                self._close_slot(slot, "failed")
            return
        self._count_speculation(scheduler)
        for event in events:
            slot = slots.get(event.sequence)
            if slot is None:                       # a verify's later tokens, after a stop string closed it
                continue
            if event.token is not None:
                slot.tokens += 1
                if slot.tokens == 1:
                    slot.first_token_at = time.monotonic()
                    self.metrics.time_to_first_token.observe(slot.first_token_at - slot.job.arrived)
                self.metrics.generation_tokens.inc()
                self._send_text(slot.job, slot.stops.push(slot.decoder.push(event.token)))
            if event.finish == "pool":
                runtime = self._loaded()
                slot.job.send(Failed(ApiError(400, runtime.pool_full(runtime.kv_pool + 1))))
                self._close_slot(slots.pop(event.sequence), "failed")
                continue
            if slot.stops.stopped and event.finish is None:
                scheduler.remove(event.sequence)
            if slot.stops.stopped or event.finish is not None:
                if not slot.stops.stopped:
                    self._send_text(slot.job, slot.stops.push(slot.decoder.flush()) + slot.stops.flush())
                reason = "stop" if slot.stops.stopped or event.finish == "stop" else "length"
                slot.job.send(Finished(reason, len(slot.job.prompt_ids), slot.tokens))
                self.metrics.prompt_tokens.inc(len(slot.job.prompt_ids))
                self._observe_per_token(slot.first_token_at, slot.tokens)
                self._close_slot(slots.pop(event.sequence), reason)

    def _count_speculation(self, scheduler: Scheduler) -> None:
        """The batch's speculation counters since the last step, into /metrics."""
        total = scheduler.stats.speculation
        if total is None:
            return
        counted = self._spec_counted
        self.metrics.count_speculation(SpecStats(*(now - then for now, then in zip(astuple(total), astuple(counted)))))
        self._spec_counted = SpecStats(*astuple(total))

    def _observe_per_token(self, first_token_at: float, tokens: int) -> None:
        """The time per output token after the first, of a request that gave two or more."""
        if tokens > 1:
            self.metrics.time_per_output_token.observe((time.monotonic() - first_token_at) / (tokens - 1))

    def _close_slot(self, slot: Slot, outcome: str) -> None:
        self.metrics.running.dec()
        self.metrics.request_duration.observe(time.monotonic() - slot.job.arrived)
        self.metrics.requests.labels(outcome).inc()

    def _serve(self, job: Job) -> None:
        if job.cancelled or self._stopping:
            self.metrics.requests.labels("cancelled").inc()
            return
        self._current = job
        self.metrics.running.inc()
        try:
            outcome = self._generate(job)
        except RequestError as err:
            outcome = "failed"
            job.send(Failed(ApiError(400, str(err))))
        except ShardFailed as err:                # the shard restarts: the same request may be sent again
            outcome = "failed"
            job.send(Failed(ApiError(503, str(err), type="server_error", code="layer_shard_failed")))
        except Exception as err:  # noqa: BLE001 - a bug fails its request, logged; the server goes on
            outcome = "failed"
            logger.error(f"generation failed:\n{traceback.format_exc()}")
            job.send(Failed(ApiError(500, f"generation failed: {type(err).__name__}: {err}", type="server_error")))
        finally:
            self.metrics.running.dec()
            self._current = None
        self.metrics.requests.labels(outcome).inc()

    def _generate(self, job: Job) -> str:
        """Stream one job's text; return its outcome: stop, length or cancelled."""
        runtime, metrics, stats = self.runtime, self.metrics, RunStats()
        decoder = runtime.tokenizer.stream_decoder(skip_special=True)
        stops = StopMatcher(job.generation.stop)
        tokens = runtime.generate(job.prompt_ids, job.max_tokens, job.generation.sampling,
                                  runtime.tokenizer.stop_ids, stats, speculation=self.speculation)
        first_token_at = 0.0
        for token in tokens:
            if stats.generated_tokens == 1:
                first_token_at = time.monotonic()
                metrics.time_to_first_token.observe(first_token_at - job.arrived)
            metrics.generation_tokens.inc()
            self._send_text(job, stops.push(decoder.push(token)))
            if stops.stopped or job.cancelled:
                tokens.close()
                break
        else:
            self._send_text(job, stops.push(decoder.flush()) + stops.flush())
        metrics.prompt_tokens.inc(stats.prompt_tokens)
        metrics.prompt_tokens_per_second.set(stats.prefill_tokens_per_second)
        if stats.decode_steps:
            metrics.generation_tokens_per_second.set(stats.decode_tokens_per_second)
        if stats.speculation is not None:
            metrics.count_speculation(stats.speculation)
        metrics.request_duration.observe(time.monotonic() - job.arrived)
        if job.cancelled:
            return "cancelled"
        self._observe_per_token(first_token_at, stats.generated_tokens)
        reason = "stop" if stops.stopped or stats.finish == "stop" else "length"     # context full: length
        job.send(Finished(reason, stats.prompt_tokens, stats.generated_tokens))
        return reason

    @staticmethod
    def _send_text(job: Job, text: str) -> None:
        if text:
            job.send(Piece(text))
