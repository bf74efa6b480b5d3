"""The `moerun` command line."""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
from pathlib import Path

import click
import numpy as np

from moerun.bench import bench
from moerun.cli_options import (
    DEMO_DAEMONS,
    config_option,
    fill_from_file,
    friendly_errors,
    given_on_command_line,
    open_runtime,
    runtime_options,
)
from moerun.config import (
    REMOTE_ENDPOINT,
    ConfigError,
)
from moerun.config_file import load_config_file
from moerun.engine.generator import DEFAULT_UBATCH, RunStats, Runtime
from moerun.engine.report import stats_document, stats_table
from moerun.engine.sampler import SamplingParams
from moerun.gguf.chat import render_messages
from moerun.gguf.reader import GGUFFile
from moerun.keys import keys
from moerun.launch import launch
from moerun.models import load_spec
from moerun.moe.hotness import RoutingCounter, read_hotness, write_hotness
from moerun.moe.planner import (
    KV_BYTES_PER_ELEMENT,
    DeviceBudget,
    PlanRequest,
    explain,
    model_sizes,
)
from moerun.moe.planner import plan as make_plan
from moerun.server.command import serve
from moerun.systemd import systemd
from moerun.units import parse_bytes

DEFAULT_PROMPT = "The experts"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moerun")
def main() -> None:
    """Run Mixture-of-Experts LLMs from GGUF files."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C does, so daemons and shared memory are released."""
    raise SystemExit(128 + signum)


@main.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None,
              help="GGUF model file [default: the built-in demo model].")
@click.option("-p", "--prompt", default=None, help=f"Prompt text [default: {DEFAULT_PROMPT!r}].")
@click.option("--chat", is_flag=True, help="Render the prompt with the model's chat template; "
              "without -p, read user turns from standard input.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=0), default=128, show_default=True,
              help="Tokens to generate (stops earlier at end-of-sequence).")
@click.option("--temp", type=float, default=0.8, show_default=True, help="Temperature; 0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=0.95, show_default=True, help="1.0 = off.")
@click.option("--min-p", type=float, default=0.05, show_default=True, help="0.0 = off.")
@click.option("--repeat-penalty", type=float, default=1.0, show_default=True, help="1.0 = off.")
@click.option("--repeat-last-n", type=click.IntRange(min=0), default=64, show_default=True)
@click.option("--seed", type=int, default=None, help="Sampling seed [default: random].")
@runtime_options
@click.option("--stats", is_flag=True, help="Print throughput, MoE and per-daemon figures to stderr.")
@click.option("--stats-json", type=click.Path(dir_okay=False), default=None, help="Write the stats as JSON.")
@friendly_errors
def run(model, prompt, chat, n_predict, temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed,
        stats, stats_json, **runtime_flags):
    """Generate text, streaming it to stdout.

    Without -m, runs the built-in demo model — on the CPU with two CPU expert daemons
    over shared memory, printing the stats table, or on the --device given."""
    if model is None:
        from moerun.models.default import DESCRIPTION, default_model_path
        click.echo(DESCRIPTION, err=True)
        model = default_model_path()
        if not runtime_flags["daemons"] and runtime_flags["device"] == "cpu":
            runtime_flags["daemons"] = DEMO_DAEMONS
            stats = True
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
        _report(stats_document(runtime, run_stats, seed=seed), stats, stats_json)


def _generate(runtime: Runtime, ids: list[int], n_predict: int, sampling: SamplingParams, stats: RunStats) -> str:
    decoder = runtime.tokenizer.stream_decoder()
    pieces = []
    for token in runtime.generate(ids, n_predict, sampling, runtime.tokenizer.stop_ids, stats):
        piece = decoder.push(token)
        pieces.append(piece)
        click.echo(piece, nl=False)
    pieces.append(decoder.flush())
    click.echo(pieces[-1], nl=False)
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


def _report(document: dict, show: bool, json_path: str | None) -> None:
    if show:
        click.echo(stats_table(document), err=True)
    if json_path:
        _write_atomic(Path(json_path), json.dumps(document, indent=2).encode() + b"\n")


@main.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None,
              help="GGUF model file (required here or in --config).")
@click.option("--ids", required=True, help="Comma-separated token ids, e.g. 1,2,3.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Output .npy file.")
@runtime_options
@click.option("--stats", is_flag=True, help="Print MoE and per-daemon figures to stderr.")
@click.option("--stats-json", type=click.Path(dir_okay=False), default=None, help="Write the stats as JSON.")
@friendly_errors
def logits(model, ids, output, stats, stats_json, **runtime_flags):
    """Write float32 logits [T, vocab] for every position of a token sequence."""
    require(model, "-m/--model", "model")
    try:
        token_ids = [int(part) for part in ids.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {ids!r}", param_hint="--ids") from None
    runtime_flags["ctx"] = runtime_flags["ctx"] or max(len(token_ids), 1)
    with open_runtime(model, **runtime_flags) as runtime:
        run_stats = RunStats()
        result = runtime.logits(token_ids, run_stats)
        _write_atomic(Path(output), _npy_bytes(result))
        click.echo(f"wrote logits {list(result.shape)} to {output}", err=True)
        _report(stats_document(runtime, run_stats), stats, stats_json)


def require(value, flag: str, key: str) -> None:
    if value is None:
        raise click.UsageError(f"Missing option {flag} (or `{key}` in the --config file).")


def plan_config(command):
    """--config for `plan`: model, device and memory, the daemons' specs and memory, ctx, kv_pool."""
    @functools.wraps(command)
    @friendly_errors
    def with_config_file(*args, config_file, **params):
        if config_file:
            fill_from_file(params, _plan_values(config_file))
        return command(*args, **params)
    return config_option(with_config_file)


def _plan_values(config_file: str) -> dict:
    values = load_config_file(config_file)
    plan_values = {name: values[name] for name in ("model", "ctx", "kv_pool") if name in values}
    if "memory" in values:
        plan_values["parent_device"] = f"{values.get('device', 'cpu')}={values['memory']}"
    entries = values.get("daemon_entries", ())
    if entries and not given_on_command_line("daemons"):
        missing = [entry.name for entry in entries if entry.memory is None]
        if missing:
            raise ConfigError(f"{config_file}: moerun plan needs `memory` in every [[daemon]] "
                              f"(missing in {', '.join(missing)}), or --daemon SPEC=SIZE flags")
        plan_values["daemons"] = tuple(f"{entry.spec}={entry.memory}" for entry in entries)
    return plan_values


@main.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None,
              help="GGUF model file (required here or in --config).")
@click.option("--device", "parent_device", default=None, metavar="DEVICE=SIZE",
              help="The parent's device and memory, e.g. cuda:0=24GiB or cpu=64GiB "
                   "(required here or as device and memory in --config).")
@click.option("--daemon", "daemons", multiple=True, metavar="SPEC=SIZE",
              help="An expert daemon and its memory, e.g. cuda:1=16GiB or tcp://host:7070=48GiB. Repeatable.")
@click.option("--cpu", "cpu_size", default=None, metavar="SIZE", help="Add a CPU expert daemon with this much RAM.")
@click.option("--ctx", type=click.IntRange(min=1), default=None,
              help="Context length to reserve KV for (required here or in --config).")
@click.option("--kv-pool", type=click.IntRange(min=1), default=None, help="Bounded KV pool in tokens.")
@click.option("--kv-dtype", type=click.Choice(sorted(KV_BYTES_PER_ELEMENT)), default="f16", show_default=True)
@click.option("--hotness", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Routing counts from `moerun profile` [default: every expert counts the same].")
@click.option("--safety", default="512MiB", show_default=True, help="Memory kept free on every device.")
@click.option("--workspace", default="256MiB", show_default=True, help="Scratch memory per device.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Placement JSON to write.")
@plan_config
@friendly_errors
def plan(model, parent_device, daemons, cpu_size, ctx, kv_pool, kv_dtype, hotness, safety, workspace, output):
    """Place every routed expert on the parent or a daemon within the devices' memory."""
    require(model, "-m/--model", "model")
    require(parent_device, "--device DEVICE=SIZE", "memory")
    require(ctx, "--ctx", "ctx")
    parent_name, parent_bytes = _device_budget(parent_device, "--device")
    budgets = [_device_budget(spec, "--daemon") for spec in daemons]
    if cpu_size is not None:
        budgets.append(("cpu", parse_bytes(cpu_size, "--cpu")))
    with GGUFFile(model) as gguf:
        spec = load_spec(gguf)
        request = PlanRequest(
            sizes=model_sizes(gguf, spec), parent=DeviceBudget(f"parent {parent_name}", parent_bytes, is_parent=True),
            daemons=tuple(DeviceBudget(name, size) for name, size in budgets), context=ctx, kv_dtype=kv_dtype,
            kv_pool=kv_pool, routing_counts=read_hotness(hotness, spec) if hotness else None,
            safety_bytes=parse_bytes(safety, "--safety"), workspace_bytes=parse_bytes(workspace, "--workspace"))
        result = make_plan(request)
        _write_atomic(Path(output), result.placement.to_json(gguf.fingerprint()).encode() + b"\n")
    click.echo(explain(result))
    click.echo(f"wrote {output}", err=True)


def _device_budget(text: str, flag: str) -> tuple[str, int]:
    name, sep, size = text.rpartition("=")
    if not sep or not name:
        raise click.BadParameter(f"expected DEVICE=SIZE such as cuda:1=16GiB, got {text!r}", param_hint=flag)
    return name, parse_bytes(size, flag)


@main.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), required=True, help="GGUF model file.")
@click.option("-f", "--file", "prompts_file", type=click.Path(dir_okay=False, exists=True), required=True,
              help="Prompts, one per line.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Routing-count CSV to write.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=0), default=16, show_default=True,
              help="Greedy tokens generated after each prompt (decode routes differently from prefill).")
@click.option("--chat", is_flag=True, help="Render each prompt with the model's chat template.")
@click.option("--ctx", type=click.IntRange(min=1), default=None, help="Context length [default: the model's, at most 4096].")
@click.option("--ubatch", type=click.IntRange(min=1), default=DEFAULT_UBATCH, show_default=True)
@friendly_errors
def profile(model, prompts_file, output, n_predict, chat, ctx, ubatch):
    """Count how often each expert is routed to over a set of prompts (for `plan --hotness`)."""
    prompts = [line for line in Path(prompts_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise click.BadParameter("the file has no prompts", param_hint="-f")
    with Runtime(model, ctx=ctx, ubatch=ubatch) as runtime:
        counter = runtime.model.routing_counter = RoutingCounter(runtime.spec)
        tokens = 0
        for prompt in prompts:
            text = render_messages(runtime.tokenizer, [{"role": "user", "content": prompt}]) if chat else prompt
            ids = runtime.tokenizer.encode(text)[: runtime.ctx - n_predict]
            tokens += len(ids) + len(list(runtime.generate(ids, n_predict, SamplingParams(temperature=0.0),
                                                           runtime.tokenizer.stop_ids)))
        write_hotness(output, counter.counts, runtime.spec)
    click.echo(f"profiled {len(prompts)} prompts, {tokens} tokens: routing counts in {output}", err=True)


@main.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), required=True, help="GGUF model file.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda:N or hip:N.")
@click.option("--listen", required=True, metavar="ENDPOINT", help="ipc://PATH or tcp://HOST:PORT.")
@click.option("--curve-secret-key", type=click.Path(dir_okay=False), default=None,
              help="This daemon's CURVE secret key file (`moerun keys`); needed on a tcp:// address "
                   "other hosts can reach.")
@click.option("--curve-authorized-keys", type=click.Path(), default=None, metavar="FILE|DIR",
              help="Public key file, or directory of them, of the parents it serves.")
@click.option("--parent-pid", type=int, default=None, hidden=True)
@friendly_errors
def daemon(model, device, listen, curve_secret_key, curve_authorized_keys, parent_pid):
    """Serve experts of MODEL to one parent at a time; starts with none, the parent assigns them."""
    from moerun.daemons.daemon import serve
    if not REMOTE_ENDPOINT.match(listen):
        raise click.BadParameter(f"expected ipc://PATH or tcp://HOST:PORT, got {listen!r}", param_hint="--listen")
    serve(model, device, listen, parent_pid, curve_secret_key, curve_authorized_keys)


@main.command()
@click.argument("model", type=click.Path(dir_okay=False))
@friendly_errors
def inspect(model):
    """Print the architecture, hyper-parameters, tensor types and sizes of a GGUF model."""
    from moerun.models.inspect import describe
    click.echo(describe(model))


def _npy_bytes(array: np.ndarray) -> bytes:
    import io
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write a regular file through a temp file beside it and a rename, so a full disk
    never leaves a torn file; write devices and pipes (/dev/stdout) directly."""
    if path.exists() and not path.is_file():
        with path.open("wb") as stream:
            stream.write(data)
        return
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


main.add_command(serve)
main.add_command(launch)
main.add_command(systemd)
main.add_command(keys)
main.add_command(bench)
