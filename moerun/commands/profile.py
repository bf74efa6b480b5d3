"""`moerun profile`: how often each expert is routed to over a set of prompts (for `plan --hotness`)."""
from __future__ import annotations

from pathlib import Path

import click

from moerun.commands.options import (
    MODEL_HELP,
    friendly_errors,
    model_or_demo,
)
from moerun.config import threads_flag
from moerun.engine.runtime import DEFAULT_UBATCH, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.chat import render_messages
from moerun.moe.hotness import write_hotness
from moerun.rig.settings import RigConfig


@click.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None, help=MODEL_HELP)
@click.option("-f", "--file", "prompts_file", type=click.Path(dir_okay=False, exists=True), required=True,
              help="Prompts, one per line.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Routing-count CSV to write.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=0), default=16, show_default=True,
              help="Greedy tokens generated after each prompt (decode routes differently from prefill).")
@click.option("--chat", is_flag=True, help="Render each prompt with the model's chat template.")
@click.option("--ctx", type=click.IntRange(min=1), default=None,
              help="Context length [default: the model's, at most 4096].")
@click.option("--ubatch", type=click.IntRange(min=1), default=DEFAULT_UBATCH, show_default=True)
@threads_flag
@friendly_errors
def profile(model, prompts_file, output, n_predict, chat, ctx, ubatch, threads):
    """Count how often each expert is routed to over a set of prompts (for `plan --hotness`)."""
    prompts = [line for line in Path(prompts_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise click.BadParameter("the file has no prompts", param_hint="-f")
    with Runtime(model_or_demo(model), ctx=ctx, ubatch=ubatch, rig=RigConfig(threads=threads),
                 count_routing=True) as runtime:
        tokens = 0
        for prompt in prompts:
            text = render_messages(runtime.tokenizer, [{"role": "user", "content": prompt}]) if chat else prompt
            ids = runtime.tokenizer.encode(text)[: runtime.ctx - n_predict]
            tokens += len(ids) + len(list(runtime.generate(ids, n_predict, SamplingParams(temperature=0.0),
                                                           runtime.tokenizer.stop_ids)))
        write_hotness(output, runtime.routing_counts(), runtime.spec)
    click.echo(f"profiled {len(prompts)} prompts, {tokens} tokens: routing counts in {output}", err=True)
