"""`moerun bench`: prefill and decode throughput, in llama-bench's table shape.

    moerun bench -m model.gguf                          # pp512 and tg128, 5 repetitions each
    moerun bench -m model.gguf -p 128,512 -n 32 -r 3    # comma lists run one test per size
    moerun bench -m model.gguf -o json                  # the same fields, plus every sample
    moerun bench -m model.gguf -p 512 -n 0              # a size of 0 skips that kind of test
    moerun bench -m model.gguf -d 0,16384               # each test also after 16384 tokens of context

Every flag that `moerun run` takes for the runtime (--device, --daemon, --ubatch, --config, ...)
applies too; a --config file may name the model.

- pp<N>: prefill N random tokens into a fresh sequence (chunked by --ubatch, logits of the last
  position only, as generation does); t/s = N / seconds.
- tg<N>: after a 1-token prompt, N greedy single-token decode steps, timed as RunStats times
  decode (forward passes only, not sampling); t/s = N / seconds.
- at a depth D (-d, llama-bench's --n-depth; the test shows as `pp512 @ d16384`): the test goes
  on from D random tokens already in the sequence. They are prefilled once per test, untimed,
  and their KV cache restored before each run (with layer shards, whose caches keep no
  snapshots: prefilled again before each run, untimed too).

Each test runs once untimed first (experts load lazily and kernels compile on first use),
then -r timed repetitions; t/s is their mean ± sample standard deviation. Token ids come
from a fixed seed, so two runs feed the model the same tokens. Without --ctx the context is
what the largest test needs, its depth included.

Each test also reports the peak memory of the parent's device from loading through the end of
that test (column peak MiB, JSON peak_device_bytes): on a GPU the memory in use on the whole device,
its context included, as nvidia-smi shows it; on the CPU the process's peak resident set
(moerun.backends.memory; every JSON key is in docs/stats.md).

With --daemon, each test also reports the rig's daemons together, per timed repetition (a
tg test's figures include its 1-token prompt): IPC calls, MiB sent and received, the parent's wait
in ms, and the compute ms the daemons report (STATS; "-" / null when one does not answer).
The table adds the columns calls, MiB, wait ms, daemon ms; the JSON adds to each test
"daemons": {calls, mib, wait_ms, daemon_ms, remote_pair_share, cache_hit_rate, streamed_pair_share,
read_pair_share} and "rig": {transport (one per daemon), mode, payload_dtype, hot, stream_threshold,
expert_cache_bytes, gpu_reads}.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from math import prod

import click
import numpy as np
from gguf import LlamaFileType

from moerun.backends.memory import device_memory_used
from moerun.commands.options import (
    MODEL_HELP,
    friendly_errors,
    model_or_demo,
    open_runtime,
    runtime_options,
)
from moerun.engine.runtime import Context, RequestError, RunStats, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.reader import GGUFFile
from moerun.rig.links import DAEMON_FAILURES
from moerun.rig.supervisor import Rig

TOKEN_SEED = 0
GREEDY = SamplingParams(temperature=0.0)
BACKEND_NAMES = {"cpu": "CPU", "cuda": "CUDA", "hip": "ROCm"}   # as llama-bench names them
COLUMNS = (("model", 30, "<"), ("size", 10, ">"), ("params", 10, ">"), ("backend", 10, "<"),
           ("test", 15, ">"), ("t/s", 20, ">"), ("peak MiB", 9, ">"))   # name, minimum width, alignment
DAEMON_COLUMNS = (("calls", 8, ">"), ("MiB", 9, ">"), ("wait ms", 9, ">"), ("daemon ms", 9, ">"))   # with --daemon


class TokenCounts(click.ParamType):
    """A token count or a comma list of them: 512 or 128,512; 0 stands for no test."""
    name = "N[,N...]"

    def convert(self, value, param, ctx) -> tuple[int, ...]:
        return tuple(n for n in _comma_counts(self, value, param, ctx, "token counts", "128,512") if n)


class Depths(click.ParamType):
    """A context depth or a comma list of them: 0 or 0,16384 (0: an empty context), each once."""
    name = "D[,D...]"

    def convert(self, value, param, ctx) -> tuple[int, ...]:
        return tuple(dict.fromkeys(_comma_counts(self, value, param, ctx, "depths", "0,16384")))


def _comma_counts(kind: click.ParamType, value, param, ctx, what: str, example: str) -> tuple[int, ...]:
    if isinstance(value, tuple):
        return value
    try:
        counts = tuple(int(part) for part in str(value).split(","))
    except ValueError:
        kind.fail(f"expected {what} separated by commas, like {example}; got {value!r}", param, ctx)
    if min(counts) < 0:
        kind.fail(f"{what} cannot be negative; got {value!r}", param, ctx)
    return counts


@dataclass(frozen=True)
class BenchTest:
    kind: str      # pp | tg
    tokens: int
    depth: int = 0   # tokens in the sequence before the test's

    @property
    def name(self) -> str:
        return f"{self.kind}{self.tokens}" + (f" @ d{self.depth}" if self.depth else "")

    @property
    def positions(self) -> int:
        """KV positions the test fills: its depth, then the prompt, or the 1-token prompt and
        every decoded token."""
        return self.depth + (self.tokens if self.kind == "pp" else self.tokens + 1)


@dataclass(frozen=True)
class ModelFacts:
    label: str      # general.name (or the file name) and the quantization
    size: int       # bytes of tensor data
    params: int
    backend: str


@click.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None, help=MODEL_HELP)
@click.option("-p", "--n-prompt", "prompt_sizes", type=TokenCounts(), default="512", show_default=True,
              help="Prompt tokens of each prefill test (pp<N>); 0: none.")
@click.option("-n", "--n-gen", "gen_sizes", type=TokenCounts(), default="128", show_default=True,
              help="Decoded tokens of each generation test (tg<N>); 0: none.")
@click.option("-d", "--n-depth", "depths", type=Depths(), default="0", show_default=True,
              help="Tokens already in the sequence before each test (llama-bench's --n-depth); a list runs "
                   "every test at each.")
@click.option("-r", "--repetitions", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed runs of each test.")
@click.option("-o", "--output", "output_format", type=click.Choice(["md", "json"]), default="md", show_default=True,
              help="md: a markdown table, row by row; json: a list with one object per test.")
@runtime_options
@friendly_errors
def bench(model, prompt_sizes, gen_sizes, depths, repetitions, output_format, **runtime_flags):
    """Measure prefill (pp) and decode (tg) tokens/s, printed as llama-bench prints them."""
    tests = [BenchTest(kind, n, depth) for depth in depths
             for kind, sizes in (("pp", prompt_sizes), ("tg", gen_sizes)) for n in sizes]
    if not tests:
        raise click.UsageError("Nothing to measure: -p and -n are both 0.")
    largest = max(tests, key=lambda t: t.positions)
    for flag in ("ctx", "kv_pool"):
        given = runtime_flags[flag]
        if given is not None and given < largest.positions:
            raise click.BadParameter(f"{given} is too small for {largest.name}, which needs {largest.positions} "
                                     f"positions; raise it or leave it out", param_hint=f"--{flag.replace('_', '-')}")
    runtime_flags["ctx"] = runtime_flags["ctx"] or largest.positions
    with open_runtime(model_or_demo(model), runtime_flags) as runtime:
        facts = _model_facts(runtime)
        rig = runtime.rig
        columns = COLUMNS + DAEMON_COLUMNS if rig else COLUMNS
        if output_format == "md":
            click.echo(_table_row(columns, {name: name for name, _, _ in columns}, facts))
            click.echo(_table_rule(columns, facts))
        rng = np.random.default_rng(TOKEN_SEED)
        documents = []
        silent: set[tuple[int, int]] = set()                 # daemons that did not answer STATS
        peak_bytes = device_memory_used(runtime.backend)     # after loading
        for test in tests:
            context = runtime.context(_token_ids(runtime, rng, test.depth)) if test.depth else None
            _measure(runtime, test, rng, context)     # warm-up: caches, lazily loaded experts, compiled kernels
            seconds, daemons = _timed_runs(runtime, test, rng, context, repetitions, silent)
            peak_bytes = max(peak_bytes, device_memory_used(runtime.backend))
            rates = [test.tokens / s for s in seconds]
            mean = statistics.fmean(rates)
            sd = statistics.stdev(rates) if len(rates) > 1 else 0.0
            document = {
                "model": facts.label, "size_bytes": facts.size, "params": facts.params, "backend": facts.backend,
                "test": test.name, "depth": test.depth, "tokens_per_second": mean, "tokens_per_second_sd": sd,
                "samples_tokens_per_second": rates, "samples_seconds": seconds, "peak_device_bytes": peak_bytes,
            }
            cells = _cells(facts, test.name, f"{mean:.2f} ± {sd:.2f}", peak_bytes)
            if daemons is not None:
                document.update(daemons=daemons, rig=_rig_settings(rig))
                cells.update(_daemon_cells(daemons))
            if output_format == "md":
                click.echo(_table_row(columns, cells, facts))
            documents.append(document)
        if output_format == "json":
            click.echo(json.dumps(documents, indent=2))


def _token_ids(runtime: Runtime, rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, runtime.spec.vocab, size=n).tolist()


def _measure(runtime: Runtime, test: BenchTest, rng: np.random.Generator, context: Context | None) -> float:
    """Seconds of one run of `test` on random token ids, in a fresh sequence or after `context`."""
    stats = RunStats()
    if test.kind == "pp":
        for _ in runtime.generate(_token_ids(runtime, rng, test.tokens), 0, GREEDY, stats=stats, context=context):
            pass
        return stats.prefill_seconds
    ids = _token_ids(runtime, rng, 1)               # the first token after it needs no decode step
    for _ in runtime.generate(ids, test.tokens + 1, GREEDY, stats=stats, context=context):
        pass
    if stats.decode_steps != test.tokens:
        raise RequestError(f"{test.name} stopped after {stats.decode_steps} decode steps (context {runtime.ctx})")
    return stats.decode_seconds


def _timed_runs(runtime: Runtime, test: BenchTest, rng: np.random.Generator, context: Context | None,
                repetitions: int, silent: set[tuple[int, int]]) -> tuple[list[float], dict | None]:
    """Seconds of each timed run; with daemons also their work per run (_per_repetition)."""
    if runtime.rig is None:
        return [_measure(runtime, test, rng, context) for _ in range(repetitions)], None
    compute_before = _daemon_compute_seconds(runtime.rig, silent)   # STATS before the counters: its bytes don't count
    before = _rig_counts(runtime)
    seconds = [_measure(runtime, test, rng, context) for _ in range(repetitions)]
    after = _rig_counts(runtime)
    compute_after = _daemon_compute_seconds(runtime.rig, silent)
    return seconds, _per_repetition(before, after, compute_before, compute_after, repetitions)


def _rig_counts(runtime: Runtime) -> dict[str, float]:
    """The parent's counters of every daemon, summed, and its routed / remote pair counts.
    Read outside the timed runs only: on a GPU the MoE stats may sync with the device."""
    counters = [link.client.counters for link in runtime.rig.links]
    moe = runtime.moe_stats().to_dict()
    return {"calls": sum(c.calls for c in counters),
            "bytes": sum(c.bytes_sent + c.bytes_received for c in counters),
            "wait_seconds": sum(c.wait_seconds for c in counters),
            "routed_pairs": moe["routed_pairs"], "remote_pairs": moe["remote_pairs"], "host_pairs": moe["host_pairs"],
            "cache_hits": moe["cache_hits"], "streamed_pairs": moe["streamed_pairs"], "read_pairs": moe["read_pairs"]}


def _daemon_compute_seconds(rig: Rig, silent: set[tuple[int, int]]) -> dict[tuple[int, int], float | None]:
    """(link index, session) -> the compute seconds each daemon that is up reports in STATS,
    None where it does not answer; one that did not answer once in a session (in `silent`) is
    not asked again, so it costs one --daemon-timeout, not one per test."""
    seconds = {}
    for link in rig.links:
        with link.lock:
            if not link.up:
                continue
            key = link.index, link.session
            seconds[key] = None
            if key in silent:
                continue
            try:
                seconds[key] = float(link.client.stats(rig.config.daemon_timeout_s)["compute_seconds"])
            except (*DAEMON_FAILURES, KeyError):
                silent.add(key)
    return seconds


def _per_repetition(before: dict, after: dict, compute_before: dict, compute_after: dict,
                    repetitions: int) -> dict[str, float | None]:
    """The daemons' work between two snapshots, per repetition. daemon_ms is None unless every
    daemon answered STATS both times and none went down or rejoined in between."""
    delta = {name: after[name] - before[name] for name in after}
    answered = compute_before.keys() == compute_after.keys() and None not in (*compute_before.values(),
                                                                               *compute_after.values())
    daemon_seconds = sum(compute_after[k] - compute_before[k] for k in compute_after) if answered else None
    return {
        "calls": delta["calls"] / repetitions,
        "mib": delta["bytes"] / 2**20 / repetitions,
        "wait_ms": delta["wait_seconds"] * 1e3 / repetitions,
        "daemon_ms": None if daemon_seconds is None else daemon_seconds * 1e3 / repetitions,
        "remote_pair_share": delta["remote_pairs"] / delta["routed_pairs"] if delta["routed_pairs"] else 0.0,
        "cache_hit_rate": delta["cache_hits"] / delta["host_pairs"] if delta["host_pairs"] else 0.0,
        "streamed_pair_share": delta["streamed_pairs"] / delta["host_pairs"] if delta["host_pairs"] else 0.0,
        "read_pair_share": delta["read_pairs"] / delta["host_pairs"] if delta["host_pairs"] else 0.0,
    }


def _rig_settings(rig: Rig) -> dict:
    config = rig.config
    return {"transport": [link.transport for link in rig.links], "mode": config.mode,
            "payload_dtype": config.expert_payload_dtype, "hot": config.hot,
            "stream_threshold": config.stream_threshold, "expert_cache_bytes": config.expert_cache_bytes,
            "gpu_reads": config.gpu_reads}


def _model_facts(runtime: Runtime) -> ModelFacts:
    gguf = runtime.gguf
    device = getattr(runtime, "device", "cpu")
    platform = getattr(device, "platform", str(device).partition(":")[0])
    return ModelFacts(
        label=f"{gguf.get('general.name') or gguf.path.stem} {_quantization(gguf)}",
        size=sum(t.nbytes for t in gguf.tensors.values()),
        params=sum(prod(t.shape) for t in gguf.tensors.values()),
        backend=BACKEND_NAMES.get(platform, platform.upper()),
    )


def _quantization(gguf: GGUFFile) -> str:
    """The file type it declares (Q4_K_M, ...), else the tensor type holding the most bytes."""
    try:
        return LlamaFileType(gguf.get("general.file_type")).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:   # absent, or a type this gguf package does not know
        pass
    bytes_by_type: dict[str, int] = {}
    for t in gguf.tensors.values():
        bytes_by_type[t.ggml_type.name] = bytes_by_type.get(t.ggml_type.name, 0) + t.nbytes
    return max(bytes_by_type, key=bytes_by_type.get)


def _cells(facts: ModelFacts, test: str, rate: str, peak_bytes: int) -> dict[str, str]:
    size = f"{facts.size / 2**30:.2f} GiB" if facts.size >= 2**30 else f"{facts.size / 2**20:.2f} MiB"
    params = f"{facts.params / 1e9:.2f} B" if facts.params >= 1e9 else f"{facts.params / 1e6:.2f} M"
    return {"model": facts.label, "size": size, "params": params, "backend": facts.backend, "test": test,
            "t/s": rate, "peak MiB": f"{peak_bytes / 2**20:.0f}"}


def _daemon_cells(daemons: dict) -> dict[str, str]:
    daemon_ms = "-" if daemons["daemon_ms"] is None else f"{daemons['daemon_ms']:.1f}"
    return {"calls": f"{daemons['calls']:.1f}", "MiB": f"{daemons['mib']:.2f}",
            "wait ms": f"{daemons['wait_ms']:.1f}", "daemon ms": daemon_ms}


def _widths(columns: tuple, facts: ModelFacts) -> list[int]:
    return [max(width, len(facts.label)) if name == "model" else width for name, width, _ in columns]


def _table_row(columns: tuple, cells: dict[str, str], facts: ModelFacts) -> str:
    parts = [f"{cells[name]:{align}{width}}" for (name, _, align), width in zip(columns, _widths(columns, facts))]
    return "| " + " | ".join(parts) + " |"


def _table_rule(columns: tuple, facts: ModelFacts) -> str:
    parts = ["-" * (width - 1) + ":" if align == ">" else "-" * width
             for (_, _, align), width in zip(columns, _widths(columns, facts))]
    return "| " + " | ".join(parts) + " |"
