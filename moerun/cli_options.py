"""Pieces every model-loading command shares: the rig flags, opening a Runtime from them,
and turning expected failures into one `Error:` line."""
from __future__ import annotations

import functools
import sys

import click

from moerun.config import (
    MAX_BATCH_CAPACITY,
    MODES,
    PAYLOAD_DTYPES,
    STREAM_SLICE_TOKENS,
    TRANSPORTS,
    RigConfig,
)
from moerun.daemons.daemon import DeviceUnavailable
from moerun.engine.generator import DEFAULT_UBATCH, RequestError, Runtime
from moerun.gguf.reader import GGUFError
from moerun.gguf.tokenizer import TokenizerError
from moerun.ipc.protocol import DaemonError
from moerun.moe.rig import RigError

DEMO_DAEMONS = ("cpu", "cpu")   # the built-in demo runs with two CPU expert daemons


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
