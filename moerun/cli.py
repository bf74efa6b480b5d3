"""The `moerun` command line."""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import click
import numpy as np

from moerun.engine.generator import DEFAULT_UBATCH, RequestError, RunStats, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.chat import DEFAULT_CHATML, render_chat
from moerun.gguf.reader import GGUFError
from moerun.gguf.tokenizer import TokenizerError

DEFAULT_PROMPT = "The experts"


def friendly_errors(command):
    """Turn every expected failure into one `Error: ...` line and exit status 1."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (GGUFError, TokenizerError, RequestError, ValueError) as err:
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


def runtime_options(command):
    for option in reversed([
        click.option("--ctx", type=click.IntRange(min=1), default=None,
                     help="Context length in tokens [default: the model's, at most 4096]."),
        click.option("--ubatch", type=click.IntRange(min=1), default=DEFAULT_UBATCH, show_default=True,
                     help="Prefill chunk size in tokens."),
    ]):
        command = option(command)
    return command


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
@click.option("--stats", is_flag=True, help="Print prefill and decode tokens/s to stderr.")
@click.option("--stats-json", type=click.Path(dir_okay=False), default=None, help="Write the stats as JSON.")
@friendly_errors
def run(model, prompt, chat, n_predict, temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed,
        ctx, ubatch, stats, stats_json):
    """Generate text, streaming it to stdout."""
    if model is None:
        from moerun.models.default import DESCRIPTION, default_model_path
        click.echo(DESCRIPTION, err=True)
        model = default_model_path()
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    sampling = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)
    runtime = Runtime(model, ctx=ctx, ubatch=ubatch)
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
    _report(run_stats, seed, stats, stats_json, model)


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


def _report(run_stats: RunStats, seed: int, show: bool, json_path: str | None, model) -> None:
    data = {"model": str(model), "seed": seed, **run_stats.to_dict()}
    if show:
        click.echo(
            f"prefill: {run_stats.prompt_tokens} tokens in {run_stats.prefill_seconds:.3f} s "
            f"({run_stats.prefill_tokens_per_second:.2f} tokens/s)\n"
            f"decode:  {run_stats.decode_steps} tokens in {run_stats.decode_seconds:.3f} s "
            f"({run_stats.decode_tokens_per_second:.2f} tokens/s)\n"
            f"seed:    {seed}", err=True)
    if json_path:
        _write_atomic(Path(json_path), json.dumps(data, indent=2).encode() + b"\n")


@main.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), required=True, help="GGUF model file.")
@click.option("--ids", required=True, help="Comma-separated token ids, e.g. 1,2,3.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Output .npy file.")
@runtime_options
@friendly_errors
def logits(model, ids, output, ctx, ubatch):
    """Write float32 logits [T, vocab] for every position of a token sequence."""
    try:
        token_ids = [int(part) for part in ids.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {ids!r}", param_hint="--ids") from None
    runtime = Runtime(model, ctx=ctx or max(len(token_ids), 1), ubatch=ubatch)
    result = runtime.logits(token_ids)
    _write_atomic(Path(output), _npy_bytes(result))
    click.echo(f"wrote logits {list(result.shape)} to {output}", err=True)


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
