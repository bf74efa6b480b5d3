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
from moerun.config import RUN_OPTIONS, load_config_file, rig_config
from moerun.engine.prefix_cache import PrefixCache
from moerun.engine.runtime import Runtime
from moerun.engine.speculative import BRANCHES_KEPT, SPEC_TYPES, SpecParams
from moerun.errors import MoerunError

DEMO_DAEMONS = ("cpu", "cpu")   # `moerun run` and `serve` run the built-in demo with two CPU expert daemons
MODEL_HELP = "GGUF model file [default: the built-in demo model]."


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


def speculation_options(command):
    """--spec-type, --model-draft, --draft-max, --draft-min, --draft-branches, --spec-gate/--no-spec-gate (llama.cpp's
    names), handed to the command as one `speculation` (SpecParams, engine/speculative.py); a
    draft model without a spec type means --spec-type draft, as llama.cpp's speculative examples
    take it."""
    @functools.wraps(command)
    def wrapper(*args, spec_type, model_draft, draft_max, draft_min, draft_branches, spec_gate, **kwargs):
        spec_type = spec_type or ("draft" if model_draft is not None else "none")
        speculation = SpecParams(spec_type, draft_max=draft_max, draft_min=draft_min, gated=spec_gate,
                                 draft_model=model_draft, branches=draft_branches)
        return command(*args, speculation=speculation, **kwargs)

    options = [
        click.option("--spec-type", type=click.Choice(SPEC_TYPES), default=None,
                     help="Speculative decoding: ngram drafts from the sequence itself (llama.cpp's lookup), draft "
                          "with --model-draft; auto: ngram where the sequence repeats itself, else the draft model if "
                          "given. Greedy output and sampled distributions stay as without [default: none; draft "
                          "with --model-draft]."),
        click.option("-md", "--model-draft", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="A draft model: a smaller GGUF of the same vocabulary, run on the parent's device."),
        click.option("--draft-max", "--draft", "--draft-n", "draft_max", type=click.IntRange(min=1), default=16,
                     show_default=True, help="Most tokens one verify step checks."),
        click.option("--draft-min", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Fewer tokens drafted than this: a plain step instead."),
        click.option("--draft-branches", type=click.IntRange(1, BRANCHES_KEPT), default=1, show_default=True,
                     help="n-gram drafts: the continuations of this many earlier occurrences, verified as one "
                          "tree (a CPU parent, attention-only models; elsewhere the latest alone)."),
        click.option("--spec-gate/--no-spec-gate", default=True, show_default=True,
                     help="Pause drafting while verify steps yield fewer tokens a second than plain steps."),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


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
    and --config, one flag for each of config.RUN_OPTIONS. The command receives them all, plus
    `daemon_entries` and `split_entries` from the file, to hand to open_runtime(model, flags)."""
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
    for option in reversed([config_option, *(option.flag for option in RUN_OPTIONS)]):
        decorated = option(decorated)
    return decorated


def open_runtime(model: str, flags: dict, prefix_cache: PrefixCache | None = None,
                 speculation: SpecParams = SpecParams()) -> Runtime:
    """The Runtime of a model-loading command's flags (what runtime_options hands it): the rig's
    settings from the option table (config.RUN_OPTIONS), the context and prefill chunk from the rest;
    the draft model of `speculation` loaded beside it where it speculates."""
    return Runtime(model, ctx=flags["ctx"], kv_pool=flags["kv_pool"], ubatch=flags["ubatch"], rig=rig_config(flags),
                   prefix_cache=prefix_cache, draft_model=speculation.draft_model if speculation.enabled else None)
