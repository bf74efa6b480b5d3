"""`moerun batched-bench`: several sequences decoded together, in llama-batched-bench's table.

    moerun batched-bench -m model.gguf -npp 128 -ntg 64 -npl 1,2,4,8
    moerun batched-bench -m model.gguf -npp 512 -ntg 128 -npl 1,8,16 -c 10240 --threads 16

For each prompt size PP (-npp), generation size TG (-ntg) and batch size B (-npl): B sequences
of PP random tokens prefilled together (Runtime.generate_batch over engine/scheduler.py: steps
of at most --ubatch tokens, shared among the prompts), then TG batched decode steps of one token
each; with -pps one prompt prefilled and its cache copied to the B sequences (the copies timed
with the prefill). The columns are llama-batched-bench's: N_KV = B·(PP + TG) positions (-pps:
PP + B·TG); T_PP / S_PP the prefill's seconds and B·PP / T_PP (-pps: PP / T_PP); T_TG / S_TG
the decode's seconds and B·TG / T_TG; T = T_PP + T_TG and S = N_KV / T.
A case whose N_KV passes -c is left out, as llama-batched-bench leaves it (-c: every case's by
default). One untimed case runs first (kernels, lazily touched weights). Every runtime flag of
`moerun run` applies; batched steps run on the CPU parent for now.
"""
from __future__ import annotations

import itertools
import time

import click
import numpy as np

from moerun.commands.options import MODEL_HELP, friendly_errors, model_or_demo, open_runtime, runtime_options
from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.engine.scheduler import BatchStats

GREEDY = SamplingParams(temperature=0.0)
HEADER = "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected whole numbers separated by commas, like 1,2,4; got {text!r}") from None
    if any(n < 1 for n in counts):
        raise click.BadParameter(f"every count must be at least 1; got {text!r}")
    return counts


@click.command("batched-bench")
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None, help=MODEL_HELP)
@click.option("-npp", "prompt_sizes", default="128", show_default=True, help="Prompt tokens of each sequence (a list).")
@click.option("-ntg", "gen_sizes", default="128", show_default=True, help="Decoded tokens of each sequence (a list).")
@click.option("-npl", "batch_sizes", default="1,2,4,8", show_default=True, help="Sequences decoded together (a list).")
@click.option("-pps", "shared", is_flag=True, default=False, help="One prompt shared by every sequence of a case.")
@runtime_options
@friendly_errors
def batched_bench(model, prompt_sizes, gen_sizes, batch_sizes, shared, **runtime_flags):
    """Measure several sequences prefilled and decoded together, printed as llama-batched-bench prints them."""
    cases = list(itertools.product(_counts(prompt_sizes), _counts(gen_sizes), _counts(batch_sizes)))
    def positions(pp: int, tg: int, b: int) -> int:
        return pp + b * tg if shared else b * (pp + tg)

    budget = runtime_flags["ctx"] or max(positions(*case) for case in cases)
    runnable = [case for case in cases if positions(*case) <= budget]
    if not runnable:
        raise click.BadParameter(f"{budget} positions hold none of the cases (N_KV); raise it or leave it out",
                                 param_hint="-c")
    runtime_flags["ctx"] = max(pp + tg + 1 for pp, tg, _ in runnable)          # one sequence's positions
    with open_runtime(model_or_demo(model), runtime_flags) as runtime:
        rng = np.random.default_rng(0)
        _case(runtime, rng, min(8, runnable[0][0]), 2, 1, shared)                # untimed
        click.echo(HEADER)
        click.echo("|" + "|".join("-" * (len(cell) - 1) + ":" for cell in HEADER.split("|")[1:-1]) + "|")
        for pp, tg, b in runnable:
            stats = _case(runtime, rng, pp, tg, b, shared)
            n_kv, total = positions(pp, tg, b), stats.prefill_seconds + stats.decode_seconds
            click.echo(f"| {pp:5d} | {tg:6d} | {b:4d} | {n_kv:6d} | {stats.prefill_seconds:8.3f} | "
                       f"{(1 if shared else b) * pp / stats.prefill_seconds:8.2f} | {stats.decode_seconds:8.3f} | "
                       f"{b * tg / stats.decode_seconds:8.2f} | {total:8.3f} | {n_kv / total:8.2f} |")


def _case(runtime: Runtime, rng: np.random.Generator, pp: int, tg: int, b: int, shared: bool) -> BatchStats:
    """B random prompts of PP tokens (or one, copied), then TG decode steps (the first token comes
    from the prefill)."""
    stats = BatchStats()
    if not shared:
        prompts = [rng.integers(0, runtime.spec.vocab, pp).tolist() for _ in range(b)]
        runtime.generate_batch(prompts, [tg + 1] * b, [GREEDY] * b, stats=stats)
        return stats
    scheduler = runtime.scheduler(stats)
    started = time.perf_counter()
    first = scheduler.add(rng.integers(0, runtime.spec.vocab, pp).tolist(), tg + 1, GREEDY)
    while not scheduler.running[first].tokens:            # the prompt in, its first token out
        scheduler.step()
    scheduler.fork(first, b - 1)
    stats.prefill_seconds = time.perf_counter() - started
    while scheduler.running:
        scheduler.step()
    return stats
