"""The server's worker in-process: loading and /health, arrival order, cancellation between tokens,
parallel slots and their prefix snapshots."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from starlette.testclient import TestClient

from moerun.engine.prefix_cache import PrefixCache
from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.engine.speculative import SpecParams
from moerun.gguf.reader import GGUFError
from moerun.server.app import create_app, error_response
from moerun.server.schemas import ApiError, Generation
from moerun.server.worker import Failed, Finished, Limits, Piece, Worker

GREEDY = SamplingParams(temperature=0.0)
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
        "temperature": 0}   # greedy: the demo model gives 4 tokens here without a stop
MAX_BODY = 1 << 20


def generation(max_tokens: int | None = None, stop: tuple[str, ...] = ()) -> Generation:
    return Generation(model="demo", max_tokens=max_tokens, sampling=GREEDY, stop=stop, stream=True,
                      include_usage=False)


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def sample(worker: Worker, name: str, **labels) -> float:
    return worker.metrics.registry.get_sample_value(name, labels)


def test_health_is_503_while_loading_and_200_when_ready(demo_model):
    release = threading.Event()

    def slow_open() -> Runtime:
        assert release.wait(30)
        return Runtime(demo_model)

    with TestClient(create_app(Worker(slow_open), "demo", MAX_BODY)) as client:
        assert client.get("/health").status_code == 503
        early = client.post("/v1/chat/completions", json=CHAT)
        assert early.status_code == 503 and "loading" in early.json()["error"]["message"]
        release.set()
        wait_until(lambda: client.get("/health").status_code == 200)
        assert client.get("/health").json() == {"status": "ok"}
        reply = client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_a_model_that_fails_to_load_says_why(tmp_path):
    missing = tmp_path / "missing.gguf"
    stopped = threading.Event()

    def failing_open() -> Runtime:
        raise GGUFError(missing, "not a GGUF file")

    with TestClient(create_app(Worker(failing_open, on_load_failure=stopped.set), "demo", MAX_BODY)) as client:
        assert stopped.wait(10)
        health = client.get("/health")
        assert health.status_code == 503 and "not a GGUF file" in health.json()["message"]
        assert "failed to load" in client.post("/v1/chat/completions", json=CHAT).json()["error"]["message"]


@pytest.fixture(scope="module")
def worker(demo_model):
    worker = Worker(lambda: Runtime(demo_model), Limits(max_queue=3))
    worker.start()
    wait_until(lambda: worker.ready)
    yield worker
    worker.stop()


async def drain(job) -> list:
    return [event async for event in job.events()]


def test_jobs_run_one_at_a_time_in_arrival_order(worker):
    async def scenario():
        ids = worker.text_prompt("The rig")
        jobs = [worker.submit(ids, generation(max_tokens=3)) for _ in range(3)]
        finished_order = []

        async def follow(index, job):
            await drain(job)
            finished_order.append(index)
        await asyncio.gather(*(follow(i, job) for i, job in enumerate(jobs)))
        return finished_order
    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == [0, 1, 2]


def test_a_cancelled_job_stops_between_tokens(worker):
    tokens_before = sample(worker, "moerun_generation_tokens_total")
    cancelled_before = sample(worker, "moerun_requests_total", outcome="cancelled")

    async def scenario():
        job = worker.submit(worker.text_prompt("The rig"), generation(max_tokens=3000))
        waiting = worker.submit(worker.text_prompt("The rig"), generation(max_tokens=3000))
        waiting.cancel()                                           # skipped when its turn comes
        events = job.events()
        assert isinstance(await events.__anext__(), Piece)
        job.cancel()
        follow_up = worker.submit(worker.text_prompt("The rig"), generation(max_tokens=2))
        assert isinstance((await drain(follow_up))[-1], Finished)
    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert sample(worker, "moerun_generation_tokens_total") - tokens_before < 200     # of 6002 asked for
    assert sample(worker, "moerun_requests_total", outcome="cancelled") - cancelled_before == 2


def test_stop_sequence_ends_with_finish_reason_stop(worker):
    async def scenario(stop):
        return await drain(worker.submit(worker.text_prompt("The rig"), generation(max_tokens=20, stop=stop)))
    whole = asyncio.run(scenario(()))
    text = "".join(e.text for e in whole if isinstance(e, Piece))
    stop = text[len(text) // 2:][:3]
    cut = asyncio.run(scenario((stop,)))
    assert "".join(e.text for e in cut if isinstance(e, Piece)) == text[:text.index(stop)]
    assert cut[-1].reason == "stop" and whole[-1].reason == "length"
    assert cut[-1].completion_tokens < whole[-1].completion_tokens == 20


def test_limits_and_a_full_queue_are_refused(demo_model):
    worker = Worker(lambda: Runtime(demo_model, ctx=64), Limits(max_prompt_tokens=16, max_tokens=8, max_queue=0))
    worker.start()
    try:
        wait_until(lambda: worker.ready)
        with pytest.raises(ApiError, match="at most 16"):
            worker.text_prompt("word " * 40)
        with pytest.raises(ApiError, match="outside the vocabulary"):
            worker.text_prompt([10**6])

        async def submit(max_tokens):
            return worker.submit([1, 2, 3], generation(max_tokens=max_tokens))
        with pytest.raises(ApiError, match="allows"):
            asyncio.run(submit(9))
        with pytest.raises(ApiError) as full:
            asyncio.run(submit(None))
        assert full.value.status == 503 and full.value.code == "queue_full"
        assert error_response(full.value).headers["retry-after"] == "1"
    finally:
        worker.stop()


def test_generation_errors_become_failed_events(worker):
    async def scenario():
        return await drain(worker.submit([10**6], generation(max_tokens=2)))   # past the vocabulary
    events = asyncio.run(scenario())
    assert isinstance(events[-1], Failed) and events[-1].error.status == 400


def test_a_layer_shard_that_fails_a_request_answers_503_and_the_next_request_is_served(demo_model):
    """The shard hangs (stopped): the request's step gets no answer within the timeout, the
    client gets a 503 it may retry (code layer_shard_failed), and the same request then
    succeeds on the restarted shard."""
    import signal

    from moerun.rig.settings import RigConfig
    runtimes = []

    def open_split() -> Runtime:
        runtimes.append(Runtime(demo_model, rig=RigConfig(splits=(("cpu", 2),), daemon_timeout_s=1)))
        return runtimes[-1]

    with TestClient(create_app(Worker(open_split), "demo", MAX_BODY)) as client:
        wait_until(lambda: client.get("/health").status_code == 200)
        link = runtimes[0].shards.links[0]
        link.local.process.send_signal(signal.SIGSTOP)
        failed = client.post("/v1/chat/completions", json=CHAT)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "layer_shard_failed"
        assert "layer shard s0 cpu layers 2-3 did not answer within 1 s" in failed.json()["error"]["message"]
        retried = client.post("/v1/chat/completions", json=CHAT)
        assert retried.status_code == 200 and retried.json()["usage"]["completion_tokens"] == 4
        assert link.restarts == 1


def serve_all(worker: Worker, prompts: list[str], lengths: list[int]) -> tuple[list[list], list[tuple[int, str]]]:
    """Each prompt's events, and the order in which the handlers saw (job, event kind)."""
    seen = []

    async def scenario():
        jobs = [worker.submit(worker.text_prompt(p), generation(max_tokens=n)) for p, n in zip(prompts, lengths)]

        async def follow(index, job):
            events = []
            async for event in job.events():
                events.append(event)
                seen.append((index, type(event).__name__))
            return events
        return await asyncio.gather(*(follow(i, job) for i, job in enumerate(jobs)))
    return asyncio.run(asyncio.wait_for(scenario(), 120)), seen


def test_parallel_slots_decode_requests_together_each_answered_as_alone(demo_model):
    """--parallel 3: six requests, three at a time, the others joining as slots free; each
    request's text and counts are those of the one-at-a-time worker's."""
    prompts = ["The rig", "experts", "a quiet crowd of", "The", "every token picks", "rig"]
    lengths = [12, 3, 7, 1, 9, 5]
    answers = {}
    for parallel in (1, 3):
        worker = Worker(lambda: Runtime(demo_model), Limits(parallel=parallel))
        worker.start()
        try:
            wait_until(lambda: worker.ready)
            answers[parallel], seen = serve_all(worker, prompts, lengths)
            wait_until(lambda: sample(worker, "moerun_time_per_output_token_seconds_count") == 5)   # 5 gave 2+
            steps = sample(worker, "moerun_batch_sequences_count") or 0
            assert (steps > sample(worker, "moerun_batch_sequences_bucket", le="1.0")) == (parallel > 1)
        finally:
            worker.stop()
        if parallel == 3:       # job 1 finished while job 0, which came first, still decoded
            assert seen.index((1, "Finished")) < seen.index((0, "Finished"))
    for alone, together in zip(answers[1], answers[3]):
        assert "".join(e.text for e in together if isinstance(e, Piece)) == "".join(
            e.text for e in alone if isinstance(e, Piece))
        assert together[-1] == alone[-1] and isinstance(together[-1], Finished)


@pytest.mark.parametrize("parallel", [1, 3])
def test_speculating_slots_answer_as_plain_decoding(demo_model, parallel):
    """--spec-type ngram alone and with --parallel 3: every request's text and counts are the
    plain one-at-a-time worker's, and /metrics counts the verifies."""
    prompts = ["The rig hums in the corner of the workshop. The rig hums", "experts experts experts", "The rig"]
    lengths = [24, 10, 16]
    answers = {}
    for speculation in (SpecParams(), SpecParams("ngram", gated=False)):
        worker = Worker(lambda: Runtime(demo_model), Limits(parallel=parallel if speculation.enabled else 1),
                        speculation=speculation)
        worker.start()
        try:
            wait_until(lambda: worker.ready)
            answers[speculation.enabled], _ = serve_all(worker, prompts, lengths)
            verifies = sample(worker, "moerun_spec_verify_steps_total")
        finally:
            worker.stop()
    for plain, spec in zip(answers[False], answers[True]):
        assert "".join(e.text for e in spec if isinstance(e, Piece)) == "".join(
            e.text for e in plain if isinstance(e, Piece))
        assert spec[-1] == plain[-1] and isinstance(spec[-1], Finished)
    assert verifies > 0


def test_a_cancelled_request_leaves_the_batch_and_the_others_finish(demo_model):
    worker = Worker(lambda: Runtime(demo_model), Limits(parallel=2))
    worker.start()
    try:
        wait_until(lambda: worker.ready)

        async def scenario():
            long = worker.submit(worker.text_prompt("The rig"), generation(max_tokens=3000))
            short = worker.submit(worker.text_prompt("experts"), generation(max_tokens=6))
            events = long.events()
            assert isinstance(await events.__anext__(), Piece)
            long.cancel()
            finished = (await drain(short))[-1]
            after = worker.submit(worker.text_prompt("rig"), generation(max_tokens=2))
            return finished, (await drain(after))[-1]
        finished, after = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert finished.completion_tokens == 6 and after.completion_tokens == 2
        wait_until(lambda: sample(worker, "moerun_requests_total", outcome="cancelled") == 1)
        assert sample(worker, "moerun_generation_tokens_total") < 200          # of 3000 asked for
    finally:
        worker.stop()


def test_parallel_slots_resume_a_shared_prefix_from_its_snapshot(demo_model):
    """--parallel 2 with the prefix cache (as `moerun serve` has it by default): a request whose
    prompt begins with an earlier one's resumes from that prompt's snapshot while another request
    decodes beside it; each text is the one-at-a-time worker's without a prefix cache."""
    def serve(parallel: int, prefix_cache: PrefixCache | None) -> tuple[list[list], Worker]:
        worker = Worker(lambda: Runtime(demo_model, prefix_cache=prefix_cache), Limits(parallel=parallel))
        worker.start()
        try:
            wait_until(lambda: worker.ready)
            first = worker.text_prompt("A token arrives, the router looks at it")
            earlier, _ = serve_all(worker, [first], [4])
            later, _ = serve_all(worker, [first + worker.text_prompt(" and the daemon wakes"), "The rig"], [6, 5])
        finally:
            worker.stop()
        return earlier + later, worker

    alone, _ = serve(1, None)
    together, worker = serve(2, PrefixCache(slots=4, interval=0))
    assert sample(worker, "moerun_prefix_cache_lookups_total") == 3
    assert sample(worker, "moerun_prefix_cache_hits_total") == 1
    assert sample(worker, "moerun_prefix_cache_restored_tokens_total") >= together[0][-1].prompt_tokens
    assert sample(worker, "moerun_batch_sequences_count") > sample(worker, "moerun_batch_sequences_bucket", le="1.0")
    for one, other in zip(alone, together):
        assert "".join(e.text for e in other if isinstance(e, Piece)) == "".join(
            e.text for e in one if isinstance(e, Piece))
        assert other[-1] == one[-1] and isinstance(other[-1], Finished)


def test_parallel_slots_on_a_gpu_parent_are_refused_before_anything_loads(moerun):
    result = moerun("serve", "--parallel", "4", "--device", "cuda:0", "--port", "0")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == ("Error: --parallel: requests are decoded together on the CPU "
                                                      "parent without --split for now; give --parallel 1 (the "
                                                      "default) here")
