"""`moerun run`: generate text, streaming it to stdout, or chat from standard input."""
from __future__ import annotations

import os
import sys

import click

from moerun.commands.options import (
    DEMO_DAEMONS,
    MODEL_HELP,
    friendly_errors,
    model_or_demo,
    open_runtime,
    runtime_options,
)
from moerun.commands.output import report_stats
from moerun.engine.report import stats_document
from moerun.engine.runtime import RunStats, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.chat import render_messages

DEFAULT_PROMPT = "The experts"


@click.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None, help=MODEL_HELP)
@click.option("-p", "--prompt", default=None, help=f"Prompt text [default: {DEFAULT_PROMPT!r}].")
@click.option("--chat", is_flag=True, help="Render the prompt with the model's chat template; "
              "without -p, read user turns from standard input.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=0), default=128, show_default=True,
              help="Tokens to generate (stops earlier at end-of-sequence).")
@click.option("--temp", type=click.FloatRange(min=0), default=0.8, show_default=True, help="Temperature; 0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="0 = off.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=0.95, show_default=True, help="1.0 = off.")
@click.option("--min-p", type=click.FloatRange(0, 1), default=0.05, show_default=True, help="0.0 = off.")
@click.option("--repeat-penalty", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="1.0 = off.")
@click.option("--repeat-last-n", type=click.IntRange(min=0), default=64, show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=None, help="Sampling seed [default: random].")
@runtime_options
@click.option("--stats", is_flag=True, help="Print throughput, MoE and per-daemon figures to stderr.")
@click.option("--stats-json", type=click.Path(dir_okay=False), default=None, help="Write the stats as JSON.")
@friendly_errors
def run(model, prompt, chat, n_predict, temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed,
        stats, stats_json, **runtime_flags):
    """Generate text, streaming it to stdout.

    Without -m, runs the built-in demo model — on the CPU with two CPU expert daemons
    over shared memory, printing the stats table, or on the --device given."""
    if model is None and not runtime_flags["daemons"] and runtime_flags["device"] == "cpu":
        runtime_flags["daemons"] = DEMO_DAEMONS
        stats = True
    model = model_or_demo(model)
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    sampling = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)
    with open_runtime(model, **runtime_flags) as runtime:
        tokenizer = runtime.tokenizer
        run_stats = RunStats()
        if chat and prompt is None:
            _chat_loop(runtime, n_predict, sampling, run_stats)
        else:
            text = prompt if prompt is not None else DEFAULT_PROMPT
            if chat:
                text = render_messages(tokenizer, [{"role": "user", "content": text}])
            _generate(runtime, tokenizer.encode(text), n_predict, sampling, run_stats)
            click.echo()
        report_stats(stats_document(runtime, run_stats, seed=seed), stats, stats_json)


def _generate(runtime: Runtime, ids: list[int], n_predict: int, sampling: SamplingParams, stats: RunStats) -> str:
    decoder = runtime.tokenizer.stream_decoder()
    pieces = []
    for token in runtime.generate(ids, n_predict, sampling, runtime.tokenizer.stop_ids, stats):
        piece = decoder.push(token)
        pieces.append(piece)
        click.echo(piece, nl=False)
    pieces.append(decoder.flush())
    click.echo(pieces[-1], nl=False)
    if stats.finish == "context":
        click.echo(f"\nmoerun: stopped after {stats.generated_tokens} tokens: the context of {runtime.ctx} tokens "
                   f"is full (raise --ctx)", err=True)
    return "".join(pieces)


def _chat_loop(runtime: Runtime, n_predict: int, sampling: SamplingParams, stats: RunStats) -> None:
    """Read user turns from stdin until EOF; the whole conversation is re-prefilled each turn."""
    messages: list[dict] = []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            click.echo("> ", nl=False, err=True)
        line = sys.stdin.readline()
        if not line:
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = runtime.tokenizer.encode(render_messages(runtime.tokenizer, messages))
        reply = _generate(runtime, ids, n_predict, sampling, stats)
        click.echo()
        messages.append({"role": "assistant", "content": reply})
