"""`moerun plan`: place every routed expert on the parent or a daemon within the devices' memory,
or (--split) the model's layers over devices."""
from __future__ import annotations

import functools
from pathlib import Path

import click

from moerun.backends.kv_types import KV_TYPES, check_gpu_kv_types
from moerun.commands.options import (
    MODEL_HELP,
    config_option,
    fill_from_file,
    friendly_errors,
    given_on_command_line,
    model_or_demo,
    require,
)
from moerun.commands.output import write_atomic
from moerun.config import load_config_file
from moerun.gguf.reader import GGUFFile
from moerun.models import load_spec
from moerun.moe.hotness import read_hotness
from moerun.moe.layer_split import explain_split, layer_bytes, split_layers
from moerun.moe.planner import (
    DeviceBudget,
    PlanRequest,
    explain,
    model_sizes,
)
from moerun.moe.planner import plan as make_plan
from moerun.rig.settings import ConfigError, kv_types_on
from moerun.units import parse_bytes


def plan_config(command):
    """--config for `plan`: model, device and memory, the daemons' specs and memory, ctx, kv_pool, KV types."""
    @functools.wraps(command)
    @friendly_errors
    def with_config_file(*args, config_file, **params):
        if config_file:
            fill_from_file(params, _plan_values(config_file))
        return command(*args, **params)
    return config_option(with_config_file)


def _plan_values(config_file: str) -> dict:
    values = load_config_file(config_file)
    names = ("model", "ctx", "kv_pool", "kv_dtype", "cache_type_k", "cache_type_v")
    plan_values = {name: values[name] for name in names if name in values}
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


@click.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None, help=MODEL_HELP)
@click.option("--device", "parent_device", default=None, metavar="DEVICE=SIZE",
              help="The parent's device and memory, e.g. cuda:0=24GiB or cpu=64GiB "
                   "(required here or as device and memory in --config).")
@click.option("--daemon", "daemons", multiple=True, metavar="SPEC=SIZE",
              help="An expert daemon and its memory, e.g. cuda:1=16GiB or tcp://host:7070=48GiB. Repeatable.")
@click.option("--cpu", "cpu_size", default=None, metavar="SIZE", help="Add a CPU expert daemon with this much RAM.")
@click.option("--ctx", type=click.IntRange(min=1), default=None,
              help="Context length to reserve KV for (required here or in --config).")
@click.option("--kv-pool", type=click.IntRange(min=1), default=None, help="Bounded KV pool in tokens.")
@click.option("--kv-dtype", type=click.Choice(tuple(KV_TYPES)), default=None,
              help="The parent's KV cache elements [default: the parent's own: f16 on a GPU, f32 on the CPU].")
@click.option("-ctk", "--cache-type-k", "cache_type_k", type=click.Choice(tuple(KV_TYPES)), default=None,
              help="The keys' elements alone (over --kv-dtype).")
@click.option("-ctv", "--cache-type-v", "cache_type_v", type=click.Choice(tuple(KV_TYPES)), default=None,
              help="The values' elements alone (over --kv-dtype).")
@click.option("--hotness", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Routing counts from `moerun profile` [default: every expert counts the same].")
@click.option("--safety", default="512MiB", show_default=True, help="Memory kept free on every device.")
@click.option("--workspace", default="256MiB", show_default=True, help="Scratch memory per device.")
@click.option("--expert-cache", default="0", show_default=True, metavar="SIZE",
              help="A GPU parent's expert cache (as `moerun run --expert-cache`), reserved on it.")
@click.option("--stream-threshold", type=click.Choice(("auto", "off")), default="auto", show_default=True,
              help="auto: a GPU parent with a CPU daemon keeps room for prefill streaming's two layer buffers "
                   "when experts go to the daemons; off: it will not stream.")
@click.option("--split", "splits", multiple=True, metavar="DEVICE=SIZE",
              help="A device for a layer shard and its memory, e.g. cuda:1=80GiB: print the layer ranges of a "
                   "layer split over the parent's device and these (what --split auto does) instead of placing "
                   "experts. Repeatable.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Placement JSON to write (required unless --split).")
@plan_config
@friendly_errors
def plan(model, parent_device, daemons, cpu_size, ctx, kv_pool, kv_dtype, cache_type_k, cache_type_v, hotness, safety,
         workspace, expert_cache, stream_threshold, splits, output):
    """Place every routed expert on the parent or a daemon within the devices' memory, or with
    --split the model's layers over devices."""
    model = model_or_demo(model)
    require(parent_device, "--device DEVICE=SIZE", "memory")
    require(ctx, "--ctx", "ctx")
    parent_name, parent_bytes = _device_budget(parent_device, "--device")
    kv_types = kv_types_on(parent_name, kv_dtype, cache_type_k, cache_type_v)
    if parent_name != "cpu":
        check_gpu_kv_types(kv_types)
    if splits:
        devices = [DeviceBudget(parent_name, parent_bytes, is_parent=True),
                   *(DeviceBudget(*_device_budget(text, "--split")) for text in splits)]
        with GGUFFile(model) as gguf:
            sizes = layer_bytes(gguf, load_spec(gguf), kv_pool or ctx, kv_types)
        reserve = parse_bytes(safety, "--safety") + parse_bytes(workspace, "--workspace")
        click.echo(explain_split(split_layers(sizes, devices, reserve)))
        return
    require(output, "-o/--output", "output")
    budgets = [_device_budget(spec, "--daemon") for spec in daemons]
    if cpu_size is not None:
        budgets.append(("cpu", parse_bytes(cpu_size, "--cpu")))
    on_gpu = parent_name != "cpu"
    streams = on_gpu and stream_threshold != "off" and any(name == "cpu" for name, _ in budgets)
    with GGUFFile(model) as gguf:
        spec = load_spec(gguf)
        request = PlanRequest(
            sizes=model_sizes(gguf, spec), parent=DeviceBudget(f"parent {parent_name}", parent_bytes, is_parent=True),
            daemons=tuple(DeviceBudget(name, size) for name, size in budgets), context=ctx, kv_types=kv_types,
            kv_pool=kv_pool, routing_counts=read_hotness(hotness, spec) if hotness else None,
            safety_bytes=parse_bytes(safety, "--safety"), workspace_bytes=parse_bytes(workspace, "--workspace"),
            expert_cache_bytes=parse_bytes(expert_cache, "--expert-cache") if on_gpu else 0, streams=streams)
        result = make_plan(request)
        write_atomic(Path(output), result.placement.to_json(gguf.fingerprint()).encode() + b"\n")
    click.echo(explain(result))
    click.echo(f"wrote {output}", err=True)


def _device_budget(text: str, flag: str) -> tuple[str, int]:
    name, sep, size = text.rpartition("=")
    if not sep or not name:
        raise click.BadParameter(f"expected DEVICE=SIZE such as cuda:1=16GiB, got {text!r}", param_hint=flag)
    return name, parse_bytes(size, flag)
