"""Load test for `moerun serve`: many concurrent clients, a few short greedy chat requests each.

    moerun serve --daemon cpu --daemon cpu --port 8080 &
    python scripts/load_test_server.py --url http://127.0.0.1:8080 --clients 50 --requests 3

Each prompt is first asked alone; under load, every reply (half of them streamed) must equal
that reply, text and usage. Prints throughput and latency percentiles (--json: one JSON
object); exits 1 if a request failed or was wrong or the server is unhealthy afterwards.
Talks to this machine only, and stops by itself: a bounded number of requests, a deadline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx
from openai import AsyncOpenAI

PROMPTS = ("The rig", "Tell me about the experts", "The parent", "What does a daemon do?", "Tokens per second")
LOCAL_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Outcome:
    ok: bool
    latency_s: float
    completion_tokens: int
    first_token_s: float | None = None      # streamed requests only
    problem: str = ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the server, on this machine")
    parser.add_argument("--clients", type=int, default=50, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=3, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds the whole test may take")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--api-key", default=os.environ.get("MOERUN_API_KEY", "unused"),
                        help="the server's API key [default: $MOERUN_API_KEY]")
    args = parser.parse_args()
    if urlparse(args.url).hostname not in LOCAL_HOSTS:
        parser.error(f"--url must point at this machine ({' or '.join(LOCAL_HOSTS)})")
    summary = asyncio.run(asyncio.wait_for(load_test(args), args.deadline))
    print(json.dumps(summary, indent=2) if args.json else report(summary))
    sys.exit(0 if summary["ok"] == summary["requests"] and summary["healthy_after"] else 1)


async def load_test(args) -> dict:
    async with client_for(args) as client:
        model = (await client.models.list()).data[0].id
        reference = {prompt: await ask(client, model, prompt, args.max_tokens, stream=False) for prompt in PROMPTS}
    started = time.perf_counter()
    per_client = await asyncio.gather(*(one_client(args, model, reference, i) for i in range(args.clients)))
    elapsed = time.perf_counter() - started
    outcomes = [outcome for outcomes in per_client for outcome in outcomes]
    async with httpx.AsyncClient(base_url=args.url, timeout=10) as http:
        healthy = (await http.get("/health")).status_code == 200
    return summarize(outcomes, elapsed, healthy)


def client_for(args) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, max_retries=0, timeout=args.timeout)


async def one_client(args, model: str, reference: dict[str, Answer], index: int) -> list[Outcome]:
    outcomes = []
    async with client_for(args) as client:
        for turn in range(args.requests):
            prompt, stream = PROMPTS[(index + turn) % len(PROMPTS)], (index + turn) % 2 == 0
            started = time.perf_counter()
            try:
                answer, first_token_s = await ask_timed(client, model, prompt, args.max_tokens, stream, started)
            except Exception as err:  # noqa: BLE001 - every failure is an outcome the table counts
                problem = f"{type(err).__name__}: {err}"
                outcomes.append(Outcome(False, time.perf_counter() - started, 0, problem=problem))
                continue
            problem = "" if answer == reference[prompt] else f"{answer} != {reference[prompt]}"
            outcomes.append(Outcome(not problem, time.perf_counter() - started, answer.completion_tokens,
                                    first_token_s, problem))
    return outcomes


async def ask(client: AsyncOpenAI, model: str, prompt: str, max_tokens: int, stream: bool) -> Answer:
    answer, _ = await ask_timed(client, model, prompt, max_tokens, stream, time.perf_counter())
    return answer


async def ask_timed(client: AsyncOpenAI, model: str, prompt: str, max_tokens: int, stream: bool,
                    started: float) -> tuple[Answer, float | None]:
    """The answer, and for a stream the seconds from `started` to its first text."""
    request = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                   temperature=0)
    if not stream:
        reply = await client.chat.completions.create(**request)
        return Answer(reply.choices[0].message.content, reply.usage.prompt_tokens, reply.usage.completion_tokens), None
    pieces, first_token_s, usage = [], None, None
    async for chunk in await client.chat.completions.create(**request, stream=True,
                                                            stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first_token_s = first_token_s or time.perf_counter() - started
                pieces.append(choice.delta.content)
    return Answer("".join(pieces), usage.prompt_tokens, usage.completion_tokens), first_token_s


def summarize(outcomes: list[Outcome], elapsed: float, healthy: bool) -> dict:
    latencies = [o.latency_s for o in outcomes]
    first_tokens = [o.first_token_s for o in outcomes if o.first_token_s is not None]
    return {
        "requests": len(outcomes),
        "ok": sum(o.ok for o in outcomes),
        "problems": sorted({o.problem for o in outcomes if o.problem})[:5],
        "seconds": elapsed,
        "requests_per_second": len(outcomes) / elapsed,
        "generated_tokens_per_second": sum(o.completion_tokens for o in outcomes) / elapsed,
        "latency_s": percentiles(latencies),
        "first_token_s": percentiles(first_tokens),
        "healthy_after": healthy,
    }


def percentiles(values: list[float]) -> dict:
    if len(values) < 2:
        return {}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98], "max": max(values)}


def report(summary: dict) -> str:
    lines = [f"{summary['ok']}/{summary['requests']} requests answered correctly in {summary['seconds']:.1f} s: "
             f"{summary['requests_per_second']:.2f} requests/s, "
             f"{summary['generated_tokens_per_second']:.1f} generated tokens/s"]
    for name in ("latency_s", "first_token_s"):
        cuts = summary[name]
        if cuts:
            lines.append(f"{name}: " + ", ".join(f"{key} {value:.3f}" for key, value in cuts.items()))
    lines += [f"problem: {problem}" for problem in summary["problems"]]
    lines.append(f"server healthy afterwards: {summary['healthy_after']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
