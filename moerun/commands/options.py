"""Pieces every model-loading command shares: the rig flags and --config, opening a Runtime
from them, and turning expected failures into one `Error:` line."""
from __future__ import annotations

import functools
import os
import signal
import sys

import click
from click.core import ParameterSource

from moerun.backends import GpuError, is_gpu_error
from moerun.backends.protocol import KV_DTYPES
from moerun.config import load_config_file
from moerun.engine.prefix_cache import PrefixCache
from moerun.engine.runtime import DEFAULT_UBATCH, Runtime
from moerun.errors import MoerunError
from moerun.ipc.protocol import MAX_BATCH_CAPACITY, PAYLOAD_DTYPES
from moerun.rig.settings import AUTO, MODES, RIG_TRANSPORTS, STREAM_SLICE_TOKENS, RigConfig, parse_split
from moerun.units import parse_bytes

DEMO_DAEMONS = ("cpu", "cpu")   # `moerun run` and `serve` run the built-in demo with two CPU expert daemons
MODEL_HELP = "GGUF model file [default: the built-in demo model]."


threads_option = click.option(
    "-t", "--threads", type=click.IntRange(min=1), default=None,
    help="The parent's CPU threads [default: its share of this host's CPUs, split with the CPU daemons that "
         "run here; one for a GPU parent beside them].")


def friendly_errors(command):
    """Turn every expected failure into one `Error: ...` line and exit status 1."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except MoerunError as err:
            raise click.ClickException(str(err)) from None
        except BrokenPipeError:
            _quiet_broken_pipe()
        except OSError as err:
            raise click.ClickException(f"{err.filename or ''}: {err.strerror or err}".lstrip(": ")) from None
        except KeyboardInterrupt:
            click.echo("", err=True)
            sys.exit(130)
        except Exception as err:
            if is_gpu_error(err):              # reported by the device at a later call than the kernel's
                raise click.ClickException(str(GpuError("the model's forward pass", err))) from None
            raise
    return wrapper


def _quiet_broken_pipe() -> None:
    """The reader of stdout went away (`moerun run | head`): stop as a killed writer does, in
    silence with status 128 + SIGPIPE, stdout pointed at /dev/null so the final flush cannot fail."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(128 + signal.SIGPIPE)


def config_option(command):
    """--config FILE: the file's values fill every parameter the command line leaves out."""
    return click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), default=None,
                        help="Rig config file (TOML, docs/config.md); flags given here override it.")(command)


def model_or_demo(model: str | None) -> str:
    """The model file given, else the built-in demo model (written on first use, said on stderr):
    the one rule of every command that takes -m."""
    if model is not None:
        return model
    from moerun.writers.demo import DESCRIPTION, demo_model_path
    click.echo(DESCRIPTION, err=True)
    return str(demo_model_path())


def require(value, flag: str, key: str) -> None:
    """A usage error unless a required option came from the command line or the config file."""
    if value is None:
        raise click.UsageError(f"Missing option {flag} (or `{key}` in the --config file).")


def given_on_command_line(name: str) -> bool:
    return click.get_current_context().get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def fill_from_file(params: dict, values: dict) -> None:
    """Give every parameter the command line left out the file's value, if it has one. A flag
    given on the command line also overrides the file's alternative to it (--hot, --placement)."""
    for flag, alternative in (("hot", "placement"), ("placement", "hot")):
        if given_on_command_line(flag):
            values = {name: value for name, value in values.items() if name != alternative}
    for name, value in values.items():
        if name in params and not given_on_command_line(name):
            params[name] = value


def runtime_options(command):
    """Flags shared by every command that loads a model: context, prefill chunking, the rig,
    and --config. The command receives them all, plus `daemon_entries` and `split_entries`
    from the file, to hand to open_runtime(model, **runtime_flags)."""
    @functools.wraps(command)
    @friendly_errors
    def with_config_file(*args, config_file, **params):
        parent_key_given = given_on_command_line("client_secret_key")     # --curve-secret-key
        values = load_config_file(config_file, parent_key_given=parent_key_given) if config_file else {}
        daemons_from_file = "daemons" in values and not given_on_command_line("daemons")
        fill_from_file(params, values)
        params["daemon_entries"] = values["daemon_entries"] if daemons_from_file else ()
        splits_from_file = "splits" in values and not given_on_command_line("splits")
        params["split_entries"] = values["split_entries"] if splits_from_file else ()
        return command(*args, **params)

    decorated = with_config_file
    for option in reversed([
        config_option,
        click.option("--device", default="cpu", show_default=True, metavar="DEVICE",
                     help="The parent's device: cpu, cuda:N or hip:N."),
        click.option("--graph/--no-graph", "graphs", default=True, show_default=True,
                     help="Run GPU decode steps as CUDA graphs (--no-graph: eagerly)."),
        click.option("--kv-dtype", type=click.Choice(tuple(KV_DTYPES)), default=None,
                     help="A GPU parent's KV cache elements [default: f16; the CPU parent's are f32]."),
        click.option("-c", "--ctx", "--ctx-size", "ctx", type=click.IntRange(min=1), default=None,
                     help="Context length in tokens [default: the model's, at most 4096]."),
        click.option("--kv-pool", type=click.IntRange(min=1), default=None,
                     help="Hold at most this many tokens of KV cache (a sequence that outgrows it is an error)."),
        click.option("-ub", "--ubatch", "--ubatch-size", "ubatch", type=click.IntRange(min=1), default=DEFAULT_UBATCH,
                     show_default=True,
                     help="Prefill chunk size in tokens."),
        click.option("--daemon", "daemons", multiple=True, metavar="SPEC",
                     help="Expert daemon: cpu, cuda:N or hip:N (spawned here) or ipc://PATH, tcp://HOST:PORT "
                          "(running already). Repeatable."),
        click.option("--split", "splits", multiple=True, metavar="SPEC@LAYER|auto",
                     help="Run the layers from LAYER to the next boundary in a layer shard on SPEC: cpu, cuda:N "
                          "or hip:N (spawned here) or ipc://PATH, tcp://HOST:PORT (running already: `moerun daemon "
                          "--layers A:B`). Repeatable. auto: ranges over this host's GPUs by their free memory."),
        click.option("--hot", type=click.IntRange(min=0), default=None,
                     help="Keep experts 0..N-1 of each layer on the parent, deal the rest to the daemons "
                          "[default: experts per token]."),
        click.option("--placement", default=None, metavar="FILE|auto",
                     help="Placement JSON file (docs/placement.md), or auto: plan from the free memory now."),
        click.option("--transport", type=click.Choice(RIG_TRANSPORTS), default="auto", show_default=True,
                     help="device: GPU to GPU through CUDA/HIP IPC (same host, same vendor); shared: shared "
                          "memory, pinned for GPUs (same host); stream: ZeroMQ frames; auto: the first that fits."),
        click.option("--mode", type=click.Choice(MODES), default="auto", show_default=True,
                     help=f"batched: a whole prefill chunk per call; stream: {STREAM_SLICE_TOKENS} tokens per call."),
        click.option("--batch-capacity", type=click.IntRange(1, MAX_BATCH_CAPACITY), default=1024,
                     show_default=True, help="Most prefill tokens per daemon call in batched mode."),
        click.option("--payload-dtype", type=click.Choice(tuple(PAYLOAD_DTYPES)), default=None,
                     help="Activations sent to daemons (replies are f32) and hidden states to layer shards "
                          "[default: f32; bf16 between a GPU parent and a GPU shard]."),
        click.option("--stream-threshold", default=AUTO, show_default=True, metavar="N|auto|off",
                     help="A GPU parent computes the CPU daemons' experts itself, from copies streamed to the GPU, "
                          "for prefill chunks of at least N tokens; auto: N by measuring both at start-up."),
        click.option("--expert-cache", default="0", show_default=True, metavar="SIZE",
                     help="A GPU parent's device memory for the host-RAM experts routing favours now, e.g. 8GiB."),
        click.option("--gpu-reads", default="off", show_default=True, metavar="SHARE|off",
                     help="The share (0 to 1) of the CPU daemons' experts a GPU parent multiplies itself, reading "
                          "their weights in host RAM across the bus, while the daemons compute the rest (gains "
                          "only where the daemons are short of cores rather than of memory bandwidth)."),
        click.option("--daemon-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0,
                     show_default=True, help="Seconds a daemon may take per call before the parent computes "
                                             "its experts itself."),
        click.option("--require-daemons", is_flag=True,
                     help="Stop with an error instead of computing a failed daemon's experts on the parent."),
        click.option("--curve-secret-key", "client_secret_key", type=click.Path(dir_okay=False), default=None,
                     metavar="FILE",
                     help="This parent's CURVE secret key file (`moerun keys`), for daemons that authenticate "
                          "their parents."),
        click.option("--daemon-public-key", "daemon_public_keys", multiple=True, metavar="FILE",
                     help="The CURVE public key file of a daemon the parent connects to: one for each ipc:// or "
                          "tcp:// --daemon, then --split, in order, or one for all. Repeatable."),
        threads_option,
        click.option("--pin", is_flag=True,
                     help="Hold the parent and each CPU daemon it starts to CPUs of its own (Linux)."),
    ]):
        decorated = option(decorated)
    return decorated


def open_runtime(model, ctx, kv_pool, ubatch, device, graphs, kv_dtype, daemons, splits, hot, placement, transport,
                 mode, batch_capacity, payload_dtype, stream_threshold, expert_cache, gpu_reads, daemon_timeout,
                 require_daemons,
                 threads, pin, daemon_entries, split_entries, client_secret_key, daemon_public_keys,
                 prefix_cache: PrefixCache | None = None) -> Runtime:
    rig = RigConfig(daemons=tuple(daemons), hot=hot, placement=placement, transport=transport, mode=mode,
                    batch_capacity=batch_capacity, payload_dtype=payload_dtype, daemon_timeout_s=daemon_timeout,
                    require_daemons=require_daemons, device=device, graphs=graphs, kv_dtype=kv_dtype,
                    daemon_entries=daemon_entries, client_secret_key=client_secret_key,
                    daemon_public_keys=tuple(daemon_public_keys), threads=threads, pin=pin,
                    splits=tuple(parse_split(text) for text in splits if text != AUTO), split_auto=AUTO in splits,
                    split_entries=split_entries, stream_threshold=stream_threshold,
                    expert_cache_bytes=parse_bytes(expert_cache, "--expert-cache"), gpu_reads=gpu_reads)
    return Runtime(model, ctx=ctx, kv_pool=kv_pool, ubatch=ubatch, rig=rig, prefix_cache=prefix_cache)
