"""`moerun logits`: float32 logits for every position of a token sequence, as a .npy file."""
from __future__ import annotations

from pathlib import Path

import click

from moerun.commands.options import (
    MODEL_HELP,
    friendly_errors,
    model_or_demo,
    open_runtime,
    runtime_options,
)
from moerun.commands.output import npy_bytes, report_stats, write_atomic
from moerun.engine.report import stats_document
from moerun.engine.runtime import RunStats


@click.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None, help=MODEL_HELP)
@click.option("--ids", required=True, help="Comma-separated token ids, e.g. 1,2,3.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Output .npy file.")
@runtime_options
@click.option("--stats", is_flag=True, help="Print MoE and per-daemon figures to stderr.")
@click.option("--stats-json", type=click.Path(dir_okay=False), default=None, help="Write the stats as JSON.")
@friendly_errors
def logits(model, ids, output, stats, stats_json, **runtime_flags):
    """Write float32 logits [T, vocab] for every position of a token sequence."""
    model = model_or_demo(model)
    try:
        token_ids = [int(part) for part in ids.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {ids!r}", param_hint="--ids") from None
    runtime_flags["ctx"] = runtime_flags["ctx"] or max(len(token_ids), 1)
    with open_runtime(model, runtime_flags) as runtime:
        run_stats = RunStats()
        result = runtime.logits(token_ids, run_stats)
        write_atomic(Path(output), npy_bytes(result))
        click.echo(f"wrote logits {list(result.shape)} to {output}", err=True)
        report_stats(stats_document(runtime, run_stats), stats, stats_json)
