"""Run telemetry: the `--stats` table and the `--stats-json` document (names in docs/stats.md)."""
from __future__ import annotations

import io
import shutil

from rich.console import Console
from rich.table import Table

from moerun.engine.runtime import RunStats, Runtime

MIB = 1 << 20


def stats_document(runtime: Runtime, run: RunStats, **extra) -> dict:
    daemons = []
    for link in runtime.rig.links if runtime.rig else []:
        counters = link.client.counters
        daemons.append({
            "name": link.name, "spec": link.spec, "endpoint": link.client.endpoint,
            "transport": link.transport, "state": "up" if link.up else f"down: {link.down_reason}",
            "calls": counters.calls, "mib_sent": counters.bytes_sent / MIB,
            "mib_received": counters.bytes_received / MIB, "parent_wait_ms": counters.wait_seconds * 1e3,
            "daemon_compute_ms": counters.compute_seconds * 1e3,
            "fallback_calls": link.fallback_calls, "times_down": link.times_down,
            "restarts": link.restarts, "rejoins": link.rejoins,
        })
    for link in runtime.shards.links if runtime.shards else []:          # layer shards, in the same shape
        counters = link.counters
        daemons.append({
            "name": link.name, "spec": link.spec, "endpoint": link.client.endpoint if link.client else None,
            "transport": link.client.transport if link.client else "stream",
            "state": "up" if link.broken is None else f"down: {link.broken}",
            "calls": counters.calls, "mib_sent": counters.bytes_sent / MIB,
            "mib_received": counters.bytes_received / MIB, "parent_wait_ms": counters.wait_seconds * 1e3,
            "daemon_compute_ms": counters.compute_seconds * 1e3, "fallback_calls": 0,
            "times_down": link.times_down, "restarts": link.restarts, "rejoins": 0,
            "layers": [link.layers.start, link.layers.stop],
        })
    return {**extra, "model": str(runtime.gguf.path), **run.to_dict(), **runtime.moe_stats().to_dict(),
            "daemons": daemons}


def timing_line(run: RunStats) -> str:
    """The closing figures llama.cpp prints, in one line: prompt eval and eval time and speed."""
    per_token = f"{run.decode_seconds * 1e3 / run.decode_tokens:.2f} ms per token, " if run.decode_tokens else ""
    spec = run.speculation
    accepted = (f"; {spec.accepted_tokens} of {spec.drafted_tokens} drafted tokens accepted in {spec.verify_steps} "
                f"verifies" if spec is not None else "")
    return (f"moerun: prompt eval {run.prompt_tokens} tokens in {run.prefill_seconds * 1e3:.2f} ms "
            f"({run.prefill_tokens_per_second:.2f} t/s); eval {run.decode_steps} runs in "
            f"{run.decode_seconds * 1e3:.2f} ms ({per_token}{run.decode_tokens_per_second:.2f} t/s); "
            f"{run.generated_tokens} tokens generated{accepted}")


def stats_table(doc: dict, width: int | None = None) -> str:
    """The stats as text: throughput and MoE lines, then a table of the daemons laid out to
    `width` columns (the terminal's by default)."""
    lines = [
        f"prefill: {doc['prompt_tokens']} tokens in {doc['prefill_seconds']:.3f} s "
        f"({doc['prefill_tokens_per_second']:.2f} tokens/s)",
        f"decode:  {doc['decode_tokens']} tokens in {doc['decode_seconds']:.3f} s "
        f"({doc['decode_tokens_per_second']:.2f} tokens/s)",
        f"MoE:     {doc['hot_only_layer_share']:.1%} of layer calls hot-only, "
        f"{doc['remote_pair_share']:.1%} of {doc['routed_pairs']} routed pairs remote, "
        f"{doc['fallback_pairs']} computed by the parent after a daemon failed",
    ]
    spec = doc.get("speculation")
    if spec is not None:
        lines.append(f"spec:    {spec['verify_steps']} verifies, {spec['accepted_tokens']} of {spec['drafted_tokens']} "
                     f"drafted tokens accepted ({spec['mean_accepted']:.2f} a verify), {spec['paused_steps']} plain "
                     f"steps while the gate paused drafting")
    if doc.get("host_pairs"):
        lines.append(f"host:    {doc['host_pairs']} pairs to experts in host RAM: {doc['cache_hit_rate']:.1%} from the "
                     f"expert cache ({doc['cache_swaps']} swaps, {doc['cache_bytes_in'] / 2**20:.0f} MiB in), "
                     f"{doc['read_pairs']} read in place by the GPU, {doc['streamed_pairs']} streamed "
                     f"({doc['streamed_layers']} layer calls, {doc['streamed_bytes'] / 2**30:.2f} GiB copied)")
    if doc["daemons"]:
        lines += ["", _daemon_table(doc["daemons"], width)]
    if "seed" in doc:
        lines.append(f"seed:    {doc['seed']}")
    return "\n".join(lines)


DAEMON_COLUMNS = (   # heading, document key, format
    ("daemon", "name", "{}"), ("transport", "transport", "{}"), ("calls", "calls", "{}"),
    ("MiB sent", "mib_sent", "{:.2f}"), ("MiB recv", "mib_received", "{:.2f}"),
    ("wait ms", "parent_wait_ms", "{:.1f}"), ("compute ms", "daemon_compute_ms", "{:.1f}"),
    ("fallback", "fallback_calls", "{}"), ("down", "times_down", "{}"), ("restarts", "restarts", "{}"),
    ("rejoins", "rejoins", "{}"), ("state", "state", "{}"),
)
FOLDING_COLUMNS = {"daemon": 16, "state": 12}   # long texts fold within these widths at least; others never wrap


def _daemon_table(daemons: list[dict], width: int | None) -> str:
    table = Table(box=None, pad_edge=False, padding=(0, 1))
    for heading, _, format_ in DAEMON_COLUMNS:
        folds = heading in FOLDING_COLUMNS
        table.add_column(heading, justify="left" if folds or heading == "transport" else "right",
                         overflow="fold", no_wrap=not folds, min_width=FOLDING_COLUMNS.get(heading, len(heading)))
    for daemon in daemons:
        table.add_row(*(format_.format(daemon[key]) for _, key, format_ in DAEMON_COLUMNS))
    narrowest = sum(FOLDING_COLUMNS.get(heading, len(heading)) + 2 for heading, _, _ in DAEMON_COLUMNS)
    width = max(width or shutil.get_terminal_size((160, 24)).columns, narrowest)
    console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines())
