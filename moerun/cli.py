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

from moerun.config import (
    MAX_BATCH_CAPACITY,
    MODES,
    PAYLOAD_DTYPES,
    REMOTE_ENDPOINT,
    STREAM_SLICE_TOKENS,
    TRANSPORTS,
    RigConfig,
)
from moerun.daemons.daemon import DeviceUnavailable
from moerun.engine.generator import DEFAULT_UBATCH, RequestError, RunStats, Runtime
from moerun.engine.report import stats_document, stats_table
from moerun.engine.sampler import SamplingParams
from moerun.gguf.chat import DEFAULT_CHATML, render_chat
from moerun.gguf.reader import GGUFError, GGUFFile
from moerun.gguf.tokenizer import TokenizerError
from moerun.ipc.protocol import DaemonError
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
from moerun.moe.rig import RigError
from moerun.units import parse_bytes

DEFAULT_PROMPT = "The experts"
DEMO_DAEMONS = ("cpu", "cpu")


def friendly_errors(command):
    """Turn every expected failure into one `Error: ...` line and exit status 1."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        # ValueError covers ConfigError, PlacementError, PlanError, HotnessError and bad sizes
        except (GGUFError, TokenizerError, RequestError, RigError, DaemonError, DeviceUnavailable, ValueError) as err:
            raise click.ClickException(str(err)) from None
        except OSError as err:
            raise click.ClickException(f"{err.filename or ''}: {err.strerror or err}".lstrip(": ")) from None
        except KeyboardInterrupt:
            click.echo("", err=True)
            sys.exit(130)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moerun")
def main() -> None:
    """Run Mixture-of-Experts LLMs from GGUF files."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C does, so daemons and shared memory are released."""
    raise SystemExit(128 + signum)


def runtime_options(command):
    """Flags shared by every command that loads a model: context, prefill chunking, the rig."""
    for option in reversed([
        click.option("--ctx", type=click.IntRange(min=1), default=None,
                     help="Context length in tokens [default: the model's, at most 4096]."),
        click.option("--kv-pool", type=click.IntRange(min=1), default=None,
                     help="Hold at most this many tokens of KV cache (a sequence that outgrows it is an error)."),
        click.option("--ubatch", type=click.IntRange(min=1), default=DEFAULT_UBATCH, show_default=True,
                     help="Prefill chunk size in tokens."),
        click.option("--daemon", "daemons", multiple=True, metavar="SPEC",
                     help="Expert daemon: cpu, cuda:N or hip:N (spawned here) or ipc://PATH, tcp://HOST:PORT "
                          "(running already). Repeatable."),
        click.option("--hot", type=click.IntRange(min=0), default=None,
                     help="Keep experts 0..N-1 of each layer on the parent, deal the rest to the daemons "
                          "[default: experts per token]."),
        click.option("--placement", default=None, metavar="FILE|auto",
                     help="Placement JSON file (docs/placement.md), or auto: plan from the free memory now."),
        click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True,
                     help="shared: shared memory (same host); stream: ZeroMQ frames; auto: shared when possible."),
        click.option("--mode", type=click.Choice(MODES), default="auto", show_default=True,
                     help=f"batched: a whole prefill chunk per call; stream: {STREAM_SLICE_TOKENS} tokens per call."),
        click.option("--batch-capacity", type=click.IntRange(1, MAX_BATCH_CAPACITY), default=1024,
                     show_default=True, help="Most prefill tokens per daemon call in batched mode."),
        click.option("--payload-dtype", type=click.Choice(PAYLOAD_DTYPES), default="f32", show_default=True,
                     help="Activations sent to daemons (replies are f32)."),
        click.option("--daemon-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0,
                     show_default=True, help="Seconds a daemon may take per call before the parent computes "
                                             "its experts itself."),
        click.option("--require-daemons", is_flag=True,
                     help="Stop with an error instead of computing a failed daemon's experts on the parent."),
    ]):
        command = option(command)
    return command


def open_runtime(model, ctx, kv_pool, ubatch, daemons, hot, placement, transport, mode, batch_capacity, payload_dtype,
                 daemon_timeout, require_daemons) -> Runtime:
    rig = RigConfig(daemons=tuple(daemons), hot=hot, placement=placement, transport=transport, mode=mode,
                    batch_capacity=batch_capacity, payload_dtype=payload_dtype, daemon_timeout_s=daemon_timeout,
                    require_daemons=require_daemons)
    return Runtime(model, ctx=ctx, kv_pool=kv_pool, ubatch=ubatch, rig=rig)


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

    Without -m, runs the built-in demo model with two CPU expert daemons over shared
    memory and prints the stats table."""
    if model is None:
        from moerun.models.default import DESCRIPTION, default_model_path
        click.echo(DESCRIPTION, err=True)
        model = default_model_path()
        if not runtime_flags["daemons"]:
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
                text = _render(tokenizer, [{"role": "user", "content": text}])
            _generate(runtime, tokenizer.encode(text), n_predict, sampling, run_stats)
            click.echo()
        _report(stats_document(runtime, run_stats, seed=seed), stats, stats_json)


def _render(tokenizer, messages: list[dict]) -> str:
    template = tokenizer.chat_template or DEFAULT_CHATML
    return render_chat(template, messages,
                       bos_token=tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
                       eos_token=tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else "")


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
        ids = runtime.tokenizer.encode(_render(runtime.tokenizer, messages))
        reply = _generate(runtime, ids, n_predict, sampling, stats)
        click.echo()
        messages.append({"role": "assistant", "content": reply})


def _report(document: dict, show: bool, json_path: str | None) -> None:
    if show:
        click.echo(stats_table(document), err=True)
    if json_path:
        _write_atomic(Path(json_path), json.dumps(document, indent=2).encode() + b"\n")


@main.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), required=True, help="GGUF model file.")
@click.option("--ids", required=True, help="Comma-separated token ids, e.g. 1,2,3.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Output .npy file.")
@runtime_options
@click.option("--stats", is_flag=True, help="Print MoE and per-daemon figures to stderr.")
@click.option("--stats-json", type=click.Path(dir_okay=False), default=None, help="Write the stats as JSON.")
@friendly_errors
def logits(model, ids, output, stats, stats_json, **runtime_flags):
    """Write float32 logits [T, vocab] for every position of a token sequence."""
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


@main.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), required=True, help="GGUF model file.")
@click.option("--device", "parent_device", required=True, metavar="DEVICE=SIZE",
              help="The parent's device and memory, e.g. cuda:0=24GiB or cpu=64GiB.")
@click.option("--daemon", "daemons", multiple=True, metavar="SPEC=SIZE",
              help="An expert daemon and its memory, e.g. cuda:1=16GiB or tcp://host:7070=48GiB. Repeatable.")
@click.option("--cpu", "cpu_size", default=None, metavar="SIZE", help="Add a CPU expert daemon with this much RAM.")
@click.option("--ctx", type=click.IntRange(min=1), required=True, help="Context length to reserve KV for.")
@click.option("--kv-pool", type=click.IntRange(min=1), default=None, help="Bounded KV pool in tokens.")
@click.option("--kv-dtype", type=click.Choice(sorted(KV_BYTES_PER_ELEMENT)), default="f16", show_default=True)
@click.option("--hotness", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Routing counts from `moerun profile` [default: every expert counts the same].")
@click.option("--safety", default="512MiB", show_default=True, help="Memory kept free on every device.")
@click.option("--workspace", default="256MiB", show_default=True, help="Scratch memory per device.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Placement JSON to write.")
@friendly_errors
def plan(model, parent_device, daemons, cpu_size, ctx, kv_pool, kv_dtype, hotness, safety, workspace, output):
    """Place every routed expert on the parent or a daemon within the devices' memory."""
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
            text = _render(runtime.tokenizer, [{"role": "user", "content": prompt}]) if chat else prompt
            ids = runtime.tokenizer.encode(text)[: runtime.ctx - n_predict]
            tokens += len(ids) + len(list(runtime.generate(ids, n_predict, SamplingParams(temperature=0.0),
                                                           runtime.tokenizer.stop_ids)))
        write_hotness(output, counter.counts, runtime.spec)
    click.echo(f"profiled {len(prompts)} prompts, {tokens} tokens: routing counts in {output}", err=True)


@main.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), required=True, help="GGUF model file.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda:N or hip:N.")
@click.option("--listen", required=True, metavar="ENDPOINT", help="ipc://PATH or tcp://HOST:PORT.")
@click.option("--parent-pid", type=int, default=None, hidden=True)
@friendly_errors
def daemon(model, device, listen, parent_pid):
    """Serve experts of MODEL to one parent at a time; starts with none, the parent assigns them."""
    from moerun.daemons.daemon import serve
    if not REMOTE_ENDPOINT.match(listen):
        raise click.BadParameter(f"expected ipc://PATH or tcp://HOST:PORT, got {listen!r}", param_hint="--listen")
    serve(model, device, listen, parent_pid)


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

if __name__ == "__main__":
    main()
