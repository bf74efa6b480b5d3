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
    speculation_options,
)
from moerun.commands.output import report_stats
from moerun.engine.report import stats_document, timing_line
from moerun.engine.runtime import RunStats, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.engine.speculative import SpecParams
from moerun.gguf.chat import render_messages

DEFAULT_PROMPT = "The experts"


@click.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None, help=MODEL_HELP)
@click.option("-p", "--prompt", default=None, help=f"Prompt text [default: {DEFAULT_PROMPT!r}].")
@click.option("-f", "--file", "prompt_file", type=click.File("r", encoding="utf-8"), default=None,
              help="Read the prompt from this file ('-': standard input).")
@click.option("-sys", "--system-prompt", default=None,
              help="A system message before the prompt; renders it through the chat template, as --chat does.")
@click.option("--chat", is_flag=True, help="Render the prompt with the model's chat template; "
              "without -p, read user turns from standard input.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=-1), default=128, show_default=True,
              help="Tokens to generate (stops earlier at end-of-sequence); -1: until the context is full.")
@click.option("--ignore-eos", is_flag=True, help="Never sample an end-of-generation token: always generate -n tokens.")
@click.option("--temp", type=click.FloatRange(min=0), default=0.8, show_default=True, help="Temperature; 0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="0 = off.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=0.95, show_default=True, help="1.0 = off.")
@click.option("--min-p", type=click.FloatRange(0, 1), default=0.05, show_default=True, help="0.0 = off.")
@click.option("--repeat-penalty", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="1.0 = off.")
@click.option("--presence-penalty", type=click.FloatRange(-2, 2), default=0.0, show_default=True,
              help="Lowers the logit of every token seen in the last --repeat-last-n; 0.0 = off.")
@click.option("--frequency-penalty", type=click.FloatRange(-2, 2), default=0.0, show_default=True,
              help="Lowers a seen token's logit by this for every time it was seen; 0.0 = off.")
@click.option("--repeat-last-n", type=click.IntRange(min=0), default=64, show_default=True,
              help="Recent tokens the penalties look at.")
@click.option("-s", "--seed", type=click.IntRange(0, 2**32 - 1), default=None, help="Sampling seed [default: random].")
@runtime_options
@click.option("--stats", is_flag=True, help="Print throughput, MoE and per-daemon figures to stderr.")
@click.option("--stats-json", type=click.Path(dir_okay=False), default=None, help="Write the stats as JSON.")
@friendly_errors
@speculation_options
def run(model, prompt, prompt_file, system_prompt, chat, n_predict, ignore_eos, temp, top_k, top_p, min_p,
        repeat_penalty, presence_penalty, frequency_penalty, repeat_last_n, seed, speculation, stats, stats_json,
        **runtime_flags):
    """Generate text, streaming it to stdout.

    Without -m, runs the built-in demo model — on the CPU with two CPU expert daemons
    over shared memory, printing the stats table, or on the --device given."""
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("Give the prompt once: -p TEXT or -f FILE.")
    prompt = prompt_file.read() if prompt_file is not None else prompt
    if model is None and not runtime_flags["daemons"] and runtime_flags["device"] == "cpu":
        runtime_flags["daemons"] = DEMO_DAEMONS
        stats = True
    model = model_or_demo(model)
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    with open_runtime(model, runtime_flags, speculation=speculation) as runtime:
        tokenizer = runtime.tokenizer
        sampling = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                  repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                  presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, seed=seed,
                                  banned_ids=tokenizer.stop_ids if ignore_eos else frozenset())
        max_new_tokens = n_predict if n_predict >= 0 else runtime.ctx
        run_stats = RunStats()
        if (chat or system) and prompt is None:
            _chat_loop(runtime, system, max_new_tokens, sampling, speculation, run_stats)
        else:
            text = prompt if prompt is not None else DEFAULT_PROMPT
            if chat or system:
                text = render_messages(tokenizer, [*system, {"role": "user", "content": text}])
            _generate(runtime, tokenizer.encode(text), max_new_tokens, sampling, speculation, run_stats)
            click.echo()
        report_stats(stats_document(runtime, run_stats, seed=seed), stats, stats_json)
        if not stats:
            click.echo(timing_line(run_stats), err=True)


def _generate(runtime: Runtime, ids: list[int], n_predict: int, sampling: SamplingParams, speculation: SpecParams,
              stats: RunStats) -> str:
    decoder = runtime.tokenizer.stream_decoder()
    pieces = []
    for token in runtime.generate(ids, n_predict, sampling, runtime.tokenizer.stop_ids, stats,
                                  speculation=speculation):
        piece = decoder.push(token)
        pieces.append(piece)
        click.echo(piece, nl=False)
    pieces.append(decoder.flush())
    click.echo(pieces[-1], nl=False)
    if stats.finish == "context":
        click.echo(f"\nmoerun: stopped after {stats.generated_tokens} tokens: the context of {runtime.ctx} tokens "
                   f"is full (raise --ctx)", err=True)
    return "".join(pieces)


def _chat_loop(runtime: Runtime, system: list[dict], n_predict: int, sampling: SamplingParams,
               speculation: SpecParams, stats: RunStats) -> None:
    """Read user turns from stdin until EOF; the whole conversation (after the system message, if
    any) is re-prefilled each turn."""
    messages: list[dict] = list(system)
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
        reply = _generate(runtime, ids, n_predict, sampling, speculation, stats)
        click.echo()
        messages.append({"role": "assistant", "content": reply})
