"""`moerun serve` as users run it: a server process on 127.0.0.1 with CPU expert daemons,
spoken to with the official openai client, /metrics read with prometheus_client's parser,
and a bounded load test."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.chat import render_messages
from tests.server.live import SERVE, TIMEOUT_S, live_server, metric, scrape
from tests.support.live_processes import child_pids, exited, free_port

MAX_PROMPT_TOKENS = 256
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(demo_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with live_server(log, "-m", demo_model, "--daemon", "cpu", "--daemon", "cpu",
                     "--max-prompt-tokens", MAX_PROMPT_TOKENS) as (url, _):
        yield url


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def reference(demo_model):
    """The demo model in-process, all experts local."""
    with Runtime(demo_model) as runtime:
        yield runtime


def chat(client, content: str, **options):
    return client.chat.completions.create(model="demo-moe-v2", messages=[{"role": "user", "content": content}],
                                          **options)


def streamed(client, content: str, **options) -> tuple[str, list]:
    chunks = list(chat(client, content, stream=True, **options))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_model_list_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["demo-moe-v2"]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_greedy_chat_equals_moerun_run(client, moerun, demo_model):
    reply = chat(client, "Tell me about the rig", temperature=0, max_tokens=24)
    run = moerun("run", "-m", demo_model, "--chat", "-p", "Tell me about the rig", "--temp", "0", "-n", "24")
    assert run.exit_code == 0, run.output
    assert reply.choices[0].message.content == run.stdout.removesuffix("\n")
    assert reply.choices[0].finish_reason == "length" and reply.object == "chat.completion"


def test_greedy_completion_equals_moerun_run(client, moerun, demo_model):
    reply = client.completions.create(model="demo-moe-v2", prompt="The parent", temperature=0, max_tokens=16)
    run = moerun("run", "-m", demo_model, "-p", "The parent", "--temp", "0", "-n", "16")
    assert reply.choices[0].text == run.stdout.removesuffix("\n")
    streamed_text = "".join(c.choices[0].text for c in client.completions.create(
        model="demo-moe-v2", prompt="The parent", temperature=0, max_tokens=16, stream=True))
    assert streamed_text == reply.choices[0].text


def test_usage_equals_the_token_counts(client, reference):
    reply = chat(client, "What does a daemon do?", temperature=0, max_tokens=30)
    tokenizer = reference.tokenizer
    prompt_ids = tokenizer.encode(render_messages(tokenizer, [{"role": "user", "content": "What does a daemon do?"}]))
    generated = list(reference.generate(prompt_ids, 30, SamplingParams(temperature=0.0), tokenizer.stop_ids))
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(generated)
    assert reply.usage.total_tokens == len(prompt_ids) + len(generated)
    assert reply.choices[0].message.content == tokenizer.decode(generated, skip_special=True)


def test_streaming_chat_equals_the_whole_reply(client):
    whole = chat(client, "The experts", temperature=0, max_tokens=20)
    text, chunks = streamed(client, "The experts", temperature=0, max_tokens=20, stream_options={"include_usage": True})
    assert text == whole.choices[0].message.content
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_stop_sequences_end_the_text_before_them(client):
    text = chat(client, "The rig", temperature=0, max_tokens=24).choices[0].message.content
    stop = text[len(text) // 2:][:4]
    cut = chat(client, "The rig", temperature=0, max_tokens=24, stop=[stop, "never appears"])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < 24
    streamed_text, chunks = streamed(client, "The rig", temperature=0, max_tokens=24, stop=stop)
    assert streamed_text == text[:text.index(stop)] and chunks[-1].choices[0].finish_reason == "stop"


def test_a_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return chat(client, "The rig", temperature=1.0, max_tokens=30, seed=seed,
                    extra_body={"top_k": 40}).choices[0].message.content
    assert sample(7) == sample(7) != sample(8)


@pytest.mark.parametrize("body, status, words", [
    (b'{"model": "demo-moe-v2", "messages": [', 400, "not valid JSON"),
    (b'{"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}', 404, "does not exist"),
    (b'{"model": "demo-moe-v2", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}', 400,
     "max_tokens must be at least 1"),
    (json.dumps({"model": "demo-moe-v2", "messages": [{"role": "user", "content": "word " * 400}]}).encode(), 400,
     f"at most {MAX_PROMPT_TOKENS}"),
    (b'{"model": "demo-moe-v2", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}', 400,
     "the context holds"),
])
def test_bad_requests_get_4xx_with_a_message(server, body, status, words):
    reply = httpx.post(f"{server}/v1/chat/completions", content=body, timeout=TIMEOUT_S,
                       headers={"content-type": "application/json"})
    assert reply.status_code == status
    error = reply.json()["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/chat/completions", 405), ("GET", "/v2/models", 404)])
def test_unknown_routes_and_methods_get_error_bodies(server, method, path, status):
    reply = httpx.request(method, f"{server}{path}", timeout=TIMEOUT_S)
    assert reply.status_code == status and path in reply.json()["error"]["message"]


def test_a_model_that_cannot_load_ends_the_server_with_an_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    result = subprocess.run([sys.executable, *SERVE, "-m", str(bad), "--port", str(free_port())],
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith("Error: ") and "bad.gguf" in result.stderr.splitlines()[-1]


def test_the_openai_client_raises_on_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(client, "x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_PROMPT_TOKENS}"):
        chat(client, "word " * 400)


def test_metrics_counters_move(server, client):
    before = scrape(server)
    reply = chat(client, "The rig", temperature=0, max_tokens=12)
    with pytest.raises(openai.BadRequestError):
        chat(client, "x", max_tokens=0)
    after = scrape(server)

    def moved(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)
    assert moved("moerun_prompt_tokens_total") == reply.usage.prompt_tokens
    assert moved("moerun_generation_tokens_total") == reply.usage.completion_tokens == 12
    assert moved("moerun_requests_total", outcome="length") == 1
    assert moved("moerun_requests_total", outcome="rejected") == 1
    assert moved("moerun_request_duration_seconds_count") == 1
    assert metric(after, "moerun_generation_tokens_per_second") > 0
    assert metric(after, "moerun_requests_running") == metric(after, "moerun_requests_queued") == 0
    assert metric(after, "moerun_moe_fallback_pairs_total") == 0
    for name in ("moerun_moe_host_pairs", "moerun_expert_cache_hits", "moerun_stream_pairs", "moerun_read_pairs"):
        assert metric(after, f"{name}_total") == 0          # a CPU parent: the series are there, and zero
    for daemon in ("d0", "d1"):
        assert moved("moerun_daemon_calls_total", daemon=daemon, spec="cpu") > 0
        assert moved("moerun_daemon_sent_bytes_total", daemon=daemon, spec="cpu") > 0
        assert moved("moerun_daemon_wait_seconds_total", daemon=daemon, spec="cpu") > 0
        assert metric(after, "moerun_daemon_up", daemon=daemon, spec="cpu") == 1
        for supervision in ("times_down", "restarts", "rejoins"):
            assert metric(after, f"moerun_daemon_{supervision}_total", daemon=daemon, spec="cpu") == 0


def test_a_repeated_prompt_resumes_from_its_snapshot(server, client):
    before = scrape(server)
    first = chat(client, "Snapshots of the rig", temperature=0, max_tokens=6)
    second = chat(client, "Snapshots of the rig", temperature=0, max_tokens=6)
    after = scrape(server)

    def moved(name):
        return metric(after, name) - metric(before, name)
    assert second.choices[0].message.content == first.choices[0].message.content
    assert moved("moerun_prefix_cache_lookups_total") == 2 and moved("moerun_prefix_cache_hits_total") == 1
    assert moved("moerun_prefix_cache_restored_tokens_total") == second.usage.prompt_tokens
    assert metric(after, "moerun_prefix_cache_entries") >= 1 and metric(after, "moerun_prefix_cache_bytes") > 0


def test_snapshots_on_disk_serve_a_restarted_server(demo_model, tmp_path):
    folder = tmp_path / "snapshots"
    replies, samples = [], []
    for run in range(2):
        with live_server(tmp_path / f"server{run}.log", "-m", demo_model, "--prefix-cache-dir", folder) as (url, _):
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as client:
                replies.append(chat(client, "Snapshots that outlive the server", temperature=0, max_tokens=5))
            samples.append(scrape(url))
    assert replies[1].choices[0].message.content == replies[0].choices[0].message.content
    assert metric(samples[0], "moerun_prefix_cache_disk_hits_total") == 0
    assert metric(samples[1], "moerun_prefix_cache_disk_hits_total") == 1
    assert metric(samples[1], "moerun_prefix_cache_disk_files") >= 2 and list(folder.glob("*/*.snap"))


def test_parallel_slots_keep_prefix_snapshots(demo_model, tmp_path, client, reference):
    """`moerun serve --parallel 2`, its prefix cache on as by default: a prompt that begins with an
    earlier one resumes from that one's snapshot while another request decodes beside it; each
    text is the one-slot server's."""
    first = reference.tokenizer.encode("A token arrives, the router looks at it")
    later = [first + reference.tokenizer.encode(" and the daemon wakes"), reference.tokenizer.encode("The rig")]

    def complete(to, prompt: list[int]) -> str:
        return to.completions.create(model="demo-moe-v2", prompt=prompt, temperature=0, max_tokens=6).choices[0].text
    with live_server(tmp_path / "server.log", "-m", demo_model, "--parallel", 2) as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as together:
            complete(together, first)
            with ThreadPoolExecutor(2) as pool:
                texts = list(pool.map(partial(complete, together), later))
        samples = scrape(url)
    assert metric(samples, "moerun_prefix_cache_hits_total") == 1
    assert metric(samples, "moerun_prefix_cache_restored_tokens_total") >= len(first)
    assert texts == [complete(client, prompt) for prompt in later]


def wait_for_cancelled(server: str, before: float) -> dict:
    deadline = time.monotonic() + 10
    while metric(samples := scrape(server), "moerun_requests_total", outcome="cancelled") == before:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    return samples


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_stops_its_generation(server, client, stream):
    before = scrape(server)
    body = {"model": "demo-moe-v2", "messages": [{"role": "user", "content": "The rig"}], "max_tokens": 3000,
            "temperature": 0, "stream": stream}   # greedy from this prompt runs past 1500 tokens with no stop
    if stream:
        with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=TIMEOUT_S) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ") and next(lines) == ""
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server}/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    after = wait_for_cancelled(server, metric(before, "moerun_requests_total", outcome="cancelled"))
    generated = metric(after, "moerun_generation_tokens_total") - metric(before, "moerun_generation_tokens_total")
    assert generated < 1000
    assert chat(client, "The rig", temperature=0, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.slow
def test_fifty_concurrent_clients(server):
    """Every request answered correctly and none lost, and the server healthy afterwards."""
    load = subprocess.run([sys.executable, str(REPO / "scripts" / "load_test_server.py"), "--url", server,
                           "--clients", "50", "--requests", "3", "--max-tokens", "6", "--deadline", "120", "--json"],
                          capture_output=True, text=True, timeout=150)
    assert load.returncode == 0, load.stdout + load.stderr
    summary = json.loads(load.stdout)
    assert summary["requests"] == summary["ok"] == 150 and summary["healthy_after"]
    samples = scrape(server)
    assert metric(samples, "moerun_requests_running") == metric(samples, "moerun_requests_queued") == 0
    print(f"\nload test: {summary}")


def test_tiny_oracle_model_serves_like_moerun_run(tmp_path, moerun):
    """A tiny Hugging Face qwen2moe (no chat template: ChatML is used) with one daemon;
    SIGINT stops the server and its daemon."""
    from tests.support.hf_models import tiny_model
    from tests.support.to_gguf import write_gguf
    path = write_gguf(tiny_model("qwen2moe", seed=3), tmp_path / "tiny-qwen2moe.gguf", "Q8_0")
    with live_server(tmp_path / "server.log", "-m", path, "--daemon", "cpu") as (url, process):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as client:
            reply = client.chat.completions.create(model="tiny-qwen2moe", messages=[{"role": "user", "content": "hi"}],
                                                   temperature=0, max_tokens=12)
            completion = client.completions.create(model="tiny-qwen2moe", prompt="the", temperature=0, max_tokens=12)
        daemons = child_pids(process.pid)
    assert process.returncode is not None and daemons
    assert all(exited(pid) for pid in daemons)
    run_chat = moerun("run", "-m", path, "--chat", "-p", "hi", "--temp", "0", "-n", "12")
    run_text = moerun("run", "-m", path, "-p", "the", "--temp", "0", "-n", "12")
    assert reply.choices[0].message.content == run_chat.stdout.removesuffix("\n")
    assert completion.choices[0].text == run_text.stdout.removesuffix("\n")


