"""Rig config files: TOML whose keys are moerun's flags (docs/config.md).

load_config_file() checks every key and value and returns the values by the name of the
command parameter each one sets; a command fills the flags not given on its command line
from them. Every unknown key, bad value and rule broken is a message naming the key and its
line; the reader collects them all and raises one ConfigError that lists them in file order.
"""
from __future__ import annotations

import difflib
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from moerun.backends.devices import DEVICE_PATTERN
from moerun.backends.kv_types import KV_TYPES
from moerun.engine.runtime import DEFAULT_UBATCH
from moerun.engine.speculative import BRANCHES_KEPT, SPEC_TYPES
from moerun.errors import UsageError
from moerun.ipc.protocol import MAX_BATCH_CAPACITY, PAYLOAD_DTYPES
from moerun.ipc.sockets import ENDPOINT
from moerun.rig.settings import (
    AUTO,
    MODES,
    RIG_TRANSPORTS,
    STREAM_SLICE_TOKENS,
    ConfigError,
    DaemonEntry,
    RigConfig,
    SplitEntry,
    parse_split,
)
from moerun.units import parse_bytes

WORKLOADS = ("generate", "serve")
DAEMON_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


# -- value checks: each returns the value as the parameter takes it, or raises ValueError ------

def text(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise UsageError("must be a non-empty string")
    return value


def any_text(value: object) -> str:
    if not isinstance(value, str):
        raise UsageError("must be a string")
    return value


def boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise UsageError("must be true or false")
    return value


def integer(low: int | None = None, high: int | None = None) -> Callable[[object], int]:
    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError("must be an integer")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f">= {low}"
            raise UsageError(f"must be {bounds}")
        return value
    return check


def number(low: float | None = None, high: float | None = None, *,
           above: float | None = None) -> Callable[[object], float]:
    """A number within low <= value <= high and value > above, each bound optional."""
    if low is not None and high is not None and above is None:
        bounds = f"between {low:g} and {high:g}"
    else:
        bounds = " and ".join([*([f"> {above:g}"] if above is not None else []),
                               *([f">= {low:g}"] if low is not None else []),
                               *([f"<= {high:g}"] if high is not None else [])])

    def check(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise UsageError("must be a number")
        if ((above is not None and value <= above) or (low is not None and value < low)
                or (high is not None and value > high)):
            raise UsageError(f"must be {bounds}")
        return float(value)
    return check


def one_of(*choices: str) -> Callable[[object], str]:
    def check(value: object) -> str:
        if value not in choices:
            raise UsageError(f"must be one of {', '.join(choices)}")
        return value
    return check


def matching(pattern: re.Pattern, what: str) -> Callable[[object], str]:
    def check(value: object) -> str:
        if not isinstance(value, str) or not pattern.match(value):
            raise UsageError(f"must be {what}")
        return value
    return check


def size(value: object) -> str:
    try:
        parse_bytes(text(value), "size")
    except ValueError:
        raise UsageError("must be a size such as 24GiB, 512MiB or 64GB") from None
    return value


device = matching(DEVICE_PATTERN, "cpu, cuda:N or hip:N")


def gpu_reads(value: object) -> str:
    """A share from 0 to 1, or off, as the flag's text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1:
        return str(value)
    if value == "off":
        return value
    raise UsageError("must be a share from 0 to 1, or \"off\"")


def stream_threshold(value: object) -> str:
    """A number of tokens (>= 1), auto or off, as the flag's text."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return str(value)
    if value in ("auto", "off"):
        return value
    raise UsageError("must be a number of tokens (>= 1), \"auto\" or \"off\"")
endpoint = matching(ENDPOINT, "ipc://PATH or tcp://HOST:PORT")


def daemon_specs(value: object) -> tuple[str, ...]:
    """A list of --daemon values (a [[split]]'s own expert daemons)."""
    if not isinstance(value, list) or not all(isinstance(spec, str) and (DEVICE_PATTERN.match(spec)
                                                                          or ENDPOINT.match(spec)) for spec in value):
        raise UsageError("must be a list of daemons: cpu, cuda:N, hip:N, ipc://PATH or tcp://HOST:PORT")
    return tuple(value)


def api_keys(value: object) -> tuple[str, ...]:
    """A key or a list of keys, as --api-key takes them (the server checks each key's characters)."""
    keys = [value] if isinstance(value, str) else value
    if not isinstance(keys, list) or not keys or not all(isinstance(key, str) and key for key in keys):
        raise UsageError("must be a key or a list of keys (non-empty strings)")
    return tuple(keys)


@dataclass(frozen=True)
class Key:
    """A key sets the parameter of its own name (the flag with - for _)."""
    check: Callable[[object], object]
    path: bool = False           # a file name, relative to the config file's directory (~ expanded)


def field(name: str, convert: Callable[[Any], Any] = lambda value: value) -> Callable[[Any], dict]:
    """An option's value as the RigConfig field `name` (converted)."""
    return lambda value: {name: convert(value)}


def split_fields(specs: tuple[str, ...]) -> dict:
    """--split SPEC@LAYER ... and auto, as RigConfig's splits and split_auto."""
    return {"splits": tuple(parse_split(spec) for spec in specs if spec != AUTO), "split_auto": AUTO in specs}


@dataclass(frozen=True)
class RunOption:
    """One option of the commands that load a model, written once: its flag (the click
    declaration every such command takes), its top-level config-file key with the key's check
    (None: the file has none, or sets it another way), and the RigConfig fields its value sets
    (None: a Runtime argument)."""
    name: str                                   # the commands' parameter, and the config key
    flag: Callable                              # click.option(...)
    key: Key | None
    rig: Callable[[Any], dict] | None


threads_flag = click.option(
    "-t", "--threads", type=click.IntRange(min=1), default=None,
    help="The parent's CPU threads [default: its share of this host's CPUs, split with the CPU daemons that "
         "run here; one for a GPU parent beside them].")

RUN_OPTIONS = (
    RunOption("device", click.option("--device", default="cpu", show_default=True, metavar="DEVICE",
                                     help="The parent's device: cpu, cuda:N or hip:N."),
              Key(device), field("device")),
    RunOption("graphs", click.option("--graph/--no-graph", "graphs", default=True, show_default=True,
                                     help="Run GPU decode steps as CUDA graphs (--no-graph: eagerly)."),
              Key(boolean), field("graphs")),
    RunOption("kv_dtype", click.option("--kv-dtype", type=click.Choice(tuple(KV_TYPES)), default=None,
                                       help="The KV cache's keys' and values' elements [default: f32 on the CPU, "
                                            "f16 on a GPU; a GPU parent keeps f16 or f32]."),
              Key(one_of(*KV_TYPES)), field("kv_dtype")),
    RunOption("cache_type_k", click.option("-ctk", "--cache-type-k", "cache_type_k", type=click.Choice(tuple(KV_TYPES)),
                                           default=None, help="The keys' elements alone (over --kv-dtype)."),
              Key(one_of(*KV_TYPES)), field("cache_type_k")),
    RunOption("cache_type_v", click.option("-ctv", "--cache-type-v", "cache_type_v", type=click.Choice(tuple(KV_TYPES)),
                                           default=None, help="The values' elements alone (over --kv-dtype)."),
              Key(one_of(*KV_TYPES)), field("cache_type_v")),
    RunOption("ctx", click.option("-c", "--ctx", "--ctx-size", "ctx", type=click.IntRange(min=1), default=None,
                                  help="Context length in tokens [default: the model's where its KV cache fits "
                                       "beside the weights, else the most that fits; with --split the model's, at "
                                       "most 4096]."),
              Key(integer(1)), None),
    RunOption("kv_pool", click.option("--kv-pool", type=click.IntRange(min=1), default=None,
                                      help="Hold at most this many tokens of KV cache (a sequence that outgrows it "
                                           "is an error)."),
              Key(integer(1)), None),
    RunOption("ubatch", click.option("-ub", "--ubatch", "--ubatch-size", "ubatch", type=click.IntRange(min=1),
                                     default=DEFAULT_UBATCH, show_default=True, help="Prefill chunk size in tokens."),
              Key(integer(1)), None),
    RunOption("daemons", click.option("--daemon", "daemons", multiple=True, metavar="SPEC",
                                      help="Expert daemon: cpu, cuda:N or hip:N (spawned here) or ipc://PATH, "
                                           "tcp://HOST:PORT (running already). Repeatable."),
              None, field("daemons", tuple)),                  # the file's [[daemon]] tables
    RunOption("splits", click.option("--split", "splits", multiple=True, metavar="SPEC@LAYER|auto",
                                     help="Run the layers from LAYER to the next boundary in a layer shard on SPEC: "
                                          "cpu, cuda:N or hip:N (spawned here) or ipc://PATH, tcp://HOST:PORT "
                                          "(running already: `moerun daemon --layers A:B`). Repeatable. auto: "
                                          "ranges over this host's GPUs by their free memory."),
              None, split_fields),                            # the file's [[split]] tables
    RunOption("hot", click.option("--hot", type=click.IntRange(min=0), default=None,
                                  help="Keep experts 0..N-1 of each layer on the parent, deal the rest to the daemons "
                                       "[default: experts per token]."),
              Key(integer(0)), field("hot")),
    RunOption("placement", click.option("--placement", default=None, metavar="FILE|auto",
                                        help="Placement JSON file (docs/placement.md), or auto: plan from the free "
                                             "memory now."),
              Key(text, path=True), field("placement")),
    RunOption("transport", click.option("--transport", type=click.Choice(RIG_TRANSPORTS), default="auto",
                                        show_default=True,
                                        help="device: GPU to GPU through CUDA/HIP IPC (same host, same vendor); "
                                             "shared: shared memory, pinned for GPUs (same host); stream: ZeroMQ "
                                             "frames; auto: the first that fits."),
              Key(one_of(*RIG_TRANSPORTS)), field("transport")),
    RunOption("mode", click.option("--mode", type=click.Choice(MODES), default="auto", show_default=True,
                                   help=f"batched: a whole prefill chunk per call; stream: {STREAM_SLICE_TOKENS} "
                                        "tokens per call."),
              Key(one_of(*MODES)), field("mode")),
    RunOption("batch_capacity", click.option("--batch-capacity", type=click.IntRange(1, MAX_BATCH_CAPACITY),
                                             default=1024, show_default=True,
                                             help="Most prefill tokens per daemon call in batched mode."),
              Key(integer(1, MAX_BATCH_CAPACITY)), field("batch_capacity")),
    RunOption("payload_dtype", click.option("--payload-dtype", type=click.Choice(tuple(PAYLOAD_DTYPES)), default=None,
                                            help="Activations sent to daemons (replies are f32) and hidden states to "
                                                 "layer shards [default: f32; bf16 between a GPU parent and a GPU "
                                                 "shard]."),
              Key(one_of(*PAYLOAD_DTYPES)), field("payload_dtype")),
    RunOption("stream_threshold", click.option("--stream-threshold", default=AUTO, show_default=True,
                                               metavar="N|auto|off",
                                               help="A GPU parent computes the CPU daemons' experts itself, from "
                                                    "copies streamed to the GPU, for prefill chunks of at least N "
                                                    "tokens; auto: N by measuring both at start-up."),
              Key(stream_threshold), field("stream_threshold")),
    RunOption("expert_cache", click.option("--expert-cache", default="0", show_default=True, metavar="SIZE",
                                           help="A GPU parent's device memory for the host-RAM experts routing "
                                                "favours now, e.g. 8GiB."),
              Key(size), field("expert_cache_bytes", lambda text: parse_bytes(text, "--expert-cache"))),
    RunOption("gpu_reads", click.option("--gpu-reads", default="off", show_default=True, metavar="SHARE|off",
                                        help="The share (0 to 1) of the CPU daemons' experts a GPU parent multiplies "
                                             "itself, reading their weights in host RAM across the bus, while the "
                                             "daemons compute the rest (gains only where the daemons are short of "
                                             "cores rather than of memory bandwidth)."),
              Key(gpu_reads), field("gpu_reads")),
    RunOption("daemon_timeout", click.option("--daemon-timeout", type=click.FloatRange(min=0, min_open=True),
                                             default=30.0, show_default=True,
                                             help="Seconds a daemon may take per call before the parent computes "
                                                  "its experts itself."),
              Key(number(above=0)), field("daemon_timeout_s")),
    RunOption("require_daemons", click.option("--require-daemons", is_flag=True,
                                              help="Stop with an error instead of computing a failed daemon's "
                                                   "experts on the parent."),
              Key(boolean), field("require_daemons")),
    RunOption("client_secret_key", click.option("--curve-secret-key", "client_secret_key",
                                                type=click.Path(dir_okay=False), default=None, metavar="FILE",
                                                help="This parent's CURVE secret key file (`moerun keys`), for "
                                                     "daemons that authenticate their parents."),
              None, field("client_secret_key")),              # the file's [auth] client_secret_key
    RunOption("daemon_public_keys", click.option("--daemon-public-key", "daemon_public_keys", multiple=True,
                                                 metavar="FILE",
                                                 help="The CURVE public key file of a daemon the parent connects "
                                                      "to: one for each ipc:// or tcp:// --daemon, then --split, "
                                                      "in order, or one for all. Repeatable."),
              None, field("daemon_public_keys", tuple)),      # the file's curve_public_key of each table
    RunOption("threads", threads_flag, Key(integer(1)), field("threads")),
    RunOption("pin", click.option("--pin", is_flag=True,
                                  help="Hold the parent and each CPU daemon it starts to CPUs of its own (Linux)."),
              Key(boolean), field("pin")),
)


def rig_config(values: dict) -> RigConfig:
    """The RigConfig of a model-loading command's option values (every RUN_OPTIONS name, plus the
    file's daemon_entries and split_entries)."""
    fields = {}
    for option in RUN_OPTIONS:
        if option.rig is not None:
            fields.update(option.rig(values[option.name]))
    return RigConfig(**fields, daemon_entries=values["daemon_entries"], split_entries=values["split_entries"])


TOP_LEVEL = {
    "model": Key(text, path=True),
    "memory": Key(size),
    "workload": Key(one_of(*WORKLOADS)),
    **{option.name: option.key for option in RUN_OPTIONS if option.key is not None},
}
SPEC_KEYS = {                  # speculative decoding's, in both workloads' tables (docs/speculative.md)
    "spec_type": Key(one_of(*SPEC_TYPES)),
    "model_draft": Key(text, path=True),
    "draft_max": Key(integer(1)),
    "draft_min": Key(integer(0)),
    "draft_branches": Key(integer(1, BRANCHES_KEPT)),
    "spec_gate": Key(boolean),
}
TABLES = {
    "auth": {
        "client_secret_key": Key(text, path=True),
    },
    "generate": {
        "prompt": Key(any_text),
        "chat": Key(boolean),
        "n_predict": Key(integer(0)),
        "temp": Key(number(0)),
        "top_k": Key(integer(0)),
        "top_p": Key(number(above=0, high=1)),
        "min_p": Key(number(0, 1)),
        "repeat_penalty": Key(number(above=0)),
        "repeat_last_n": Key(integer(0)),
        "seed": Key(integer(0, 2**32 - 1)),
        **SPEC_KEYS,
        "stats": Key(boolean),
        "stats_json": Key(text, path=True),
    },
    "server": {
        "host": Key(text),
        "port": Key(integer(0, 65535)),
        "served_model_name": Key(text),
        "max_prompt_tokens": Key(integer(1)),
        "max_tokens": Key(integer(1)),
        "max_queue": Key(integer(1)),
        "max_body": Key(size),
        "prefix_cache_slots": Key(integer(0)),
        "snapshot_interval": Key(integer(0)),
        "prefix_cache_dir": Key(text, path=True),
        "prefix_cache_budget": Key(size),
        "api_key": Key(api_keys),
        "api_key_file": Key(text, path=True),
        "public_health": Key(boolean),
        "public_metrics": Key(boolean),
        "insecure": Key(boolean),
        **SPEC_KEYS,
    },
}
DAEMON = {
    "name": Key(matching(DAEMON_NAME, "letters, digits, _ and - only")),
    "device": Key(device),
    "endpoint": Key(endpoint),
    "listen": Key(endpoint),
    "host": Key(text),
    "transport": Key(one_of(*RIG_TRANSPORTS)),
    "memory": Key(size),
    "curve_public_key": Key(text, path=True),
    "curve_secret_key": Key(text, path=True),
    "curve_authorized_keys": Key(text, path=True),
    "threads": Key(integer(1)),
    "numa_node": Key(integer(0)),
}
SPLIT = {                      # one [[split]] table: a layer shard and the first layer it runs
    "name": Key(matching(DAEMON_NAME, "letters, digits, _ and - only")),
    "device": Key(device),
    "endpoint": Key(endpoint),
    "listen": Key(endpoint),
    "host": Key(text),
    "layer": Key(integer(1)),
    "curve_public_key": Key(text, path=True),
    "curve_secret_key": Key(text, path=True),
    "curve_authorized_keys": Key(text, path=True),
    "daemons": Key(daemon_specs),
    "hot": Key(integer(0)),
}
TOP_LEVEL_NAMES = (*TOP_LEVEL, *TABLES, "daemon", "split")


def load_config_file(path: str | Path, *rules: Rule, parent_key_given: bool = False) -> dict[str, object]:
    """The file's values by parameter name: model, ctx, prompt, port, ... as the flags take
    them, plus `daemons` (the --daemon specs), `daemon_entries` (their [[daemon]] tables),
    `client_secret_key`, `workload` and `memory`. Keys the file leaves out are absent.

    `rules` are a command's own checks: each is called with the values read so far (without
    those that had a problem) and the reader, and reports through reader.problem(). One
    ConfigError lists every problem of the reader and the rules, one a line in file order.
    parent_key_given: the command line gives the parent's CURVE secret key (--curve-secret-key),
    so a curve_public_key needs no [auth] client_secret_key here."""
    return _Reader(Path(path), parent_key_given).read(rules)


class _Reader:
    def __init__(self, path: Path, parent_key_given: bool = False):
        self.path = path
        self.parent_key_given = parent_key_given
        self.lines: dict[tuple, int] = {}
        self.problems: list[tuple[int, str]] = []     # (line to order by, message)
        self.reported: list[tuple] = []                # where each problem is, and the key a typo meant

    def read(self, rules: tuple[Rule, ...] = ()) -> dict[str, object]:
        try:
            text = self.path.read_text(encoding="utf-8")
            document = tomllib.loads(text)
        except UnicodeDecodeError as err:
            raise ConfigError(f"{self.path}: not UTF-8 text: {err}") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{self.path}: not valid TOML: {err}") from None
        self.lines = key_lines(text)
        values: dict[str, object] = {}
        for name, value in document.items():
            if name in TABLES:
                if self._is_table(name, value):
                    values.update(self._table((name,), value, TABLES[name]))
            elif name == "daemon":
                entries = self._daemons(value)
                if entries is not None:
                    values["daemons"] = tuple(entry.spec for entry in entries)
                    values["daemon_entries"] = entries
            elif name == "split":
                entries = self._splits(value)
                if entries is not None:
                    values["splits"] = tuple(f"{entry.spec}@{entry.layer}" for entry in entries)
                    values["split_entries"] = entries
            elif name in TOP_LEVEL:
                values.update(self._table((), {name: value}, TOP_LEVEL))
            else:
                self._unknown((name,), TOP_LEVEL_NAMES)
        if "hot" in values and "placement" in values:
            self.problem(("placement",), "give hot or placement, not both")
        if "client_secret_key" not in values and not self.parent_key_given and not self.failed(("auth",)):
            for table in ("daemon", "split"):
                for index, entry in enumerate(values.get(f"{table}_entries", ())):
                    if entry.curve_public_key:
                        self.problem((table, index, "curve_public_key"),
                                     f"[[{table}]] {entry.name}: curve_public_key needs [auth] client_secret_key")
        for rule in rules:
            rule(values, self)
        if self.problems:
            in_file_order = sorted(self.problems, key=lambda problem: problem[0])
            raise ConfigError("\n".join(message for _, message in in_file_order))
        return values

    def problem(self, where: tuple, message: str, *, numbered: bool = True) -> None:
        """Report a problem at `where` (("server", "port"), ("daemon", 1), () for the whole
        file): "FILE, line N: message", or "FILE: message" where `numbered` is false (it still
        takes its place in file order)."""
        line = line_of(self.lines, where)
        shown = f", line {line}" if line and numbered else ""
        self.problems.append((line or 0, f"{self.path}{shown}: {message}"))
        self.reported.append(where)

    def failed(self, where: tuple) -> bool:
        """Whether a problem was reported at `where` or within it, or a misspelt key was taken
        for it: a rule about a key stays quiet when the key itself was already reported."""
        return any(place[:len(where)] == where for place in self.reported)

    def _unknown(self, where: tuple, keys) -> None:
        name = where[-1]
        close = difflib.get_close_matches(name, keys, n=1)
        suggestion = f" (did you mean {close[0]!r}?)" if close else ""
        self.problem(where, f"unknown key {name!r}{_in(where[:-1])}{suggestion}")
        if close:
            self.reported.append(where[:-1] + (close[0],))

    def _table(self, where: tuple, table: dict, keys: dict[str, Key]) -> dict[str, object]:
        values = {}
        for name, value in table.items():
            key = keys.get(name)
            if key is None:
                self._unknown(where + (name,), keys)
                continue
            try:
                checked = key.check(value)
            except ValueError as err:
                self.problem(where + (name,), f"{name} = {value!r}: {err}")
                continue
            if key.path and not (name == "placement" and checked == AUTO):
                checked = str(self.path.parent.absolute() / Path(checked).expanduser())
            values[name] = checked
        return values

    def _daemons(self, value: object) -> tuple[DaemonEntry, ...] | None:
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            self.problem(("daemon",), "daemon must be a list of [[daemon]] tables")
            return None
        entries = []
        for index, table in enumerate(value):
            where = ("daemon", index)
            entry = DaemonEntry(**{"name": f"d{index}", **self._table(where, table, DAEMON)})
            self._check_entry(where, entry, entries)
            entries.append(entry)
        return tuple(entries)

    def _splits(self, value: object) -> tuple[SplitEntry, ...] | None:
        """[[split]] tables; --split takes each as SPEC@LAYER, SPEC its endpoint, else its device."""
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            self.problem(("split",), "split must be a list of [[split]] tables")
            return None
        entries = []
        for index, table in enumerate(value):
            where = ("split", index)
            keys = {"name": f"s{index}", **self._table(where, table, SPLIT)}
            failed = [key for key in ("device", "endpoint", "layer") if self.failed(where + (key,))]
            if "device" not in keys and "endpoint" not in keys and not failed:
                self.problem(where, f"[[split]] {keys['name']} needs a device, an endpoint or both")
            elif "layer" not in keys and not failed:
                self.problem(where, f"[[split]] {keys['name']} needs the first layer it runs (layer = N)")
            elif keys.get("listen") and not ("device" in keys and "endpoint" in keys):
                self.problem(where + ("listen",), f"[[split]] {keys['name']}: listen needs a device and an endpoint")
            elif ("curve_secret_key" in keys) != ("curve_authorized_keys" in keys):
                self.problem(where, f"[[split]] {keys['name']}: curve_secret_key and curve_authorized_keys go together")
            elif "hot" in keys and not keys.get("daemons"):
                self.problem(where + ("hot",), f"[[split]] {keys['name']}: hot is for a shard with daemons")
            elif not failed:
                entries.append(SplitEntry(**keys))
        return tuple(entries)

    def _check_entry(self, where: tuple, entry: DaemonEntry, before: list[DaemonEntry]) -> None:
        """The rules of one [[daemon]] table, each quiet where a key it reads had a bad value."""
        def failed(*keys: str) -> bool:
            return any(self.failed(where + (key,)) for key in keys)

        def missing(*keys: str) -> bool:      # not in the table, nor reported as misspelt or bad
            return any(getattr(entry, key) is None and not failed(key) for key in keys)

        name = entry.name
        if entry.spec is None and not failed("device", "endpoint"):
            self.problem(where, f"[[daemon]] {name} needs a device, an endpoint or both")
        if entry.listen and missing("device", "endpoint"):
            self.problem(where + ("listen",), f"[[daemon]] {name}: listen needs a device and an endpoint")
        if ((entry.curve_secret_key is None) != (entry.curve_authorized_keys is None)
                and not failed("curve_secret_key", "curve_authorized_keys")):
            self.problem(where, f"[[daemon]] {name}: curve_secret_key and curve_authorized_keys go together")
        for key in ("threads", "numa_node"):
            if getattr(entry, key) is not None and entry.device != "cpu" and not failed("device"):
                self.problem(where + (key,), f"[[daemon]] {name}: {key} is for a CPU daemon (device = \"cpu\")")
        if not failed("name") and any(other.name == name and not self.failed(("daemon", number, "name"))
                                      for number, other in enumerate(before)):
            self.problem(where + ("name",), f"two [[daemon]] tables are named {name!r}")

    def _is_table(self, name: str, value: object) -> bool:
        if not isinstance(value, dict):
            self.problem((name,), f"{name} must be a table ([{name}])")
            return False
        return True


Rule = Callable[[dict, _Reader], None]


def _in(where: tuple) -> str:
    return f" in [[{where[0]}]]" if len(where) == 2 else f" in [{where[0]}]" if where else ""


# -- line numbers: tomllib gives none, so find each key in the text within its table ----------

HEADER = re.compile(r"^\s*(\[\[?)\s*([^\[\]]+?)\s*\]\]?\s*(#.*)?$")
BARE_OR_QUOTED = r"""(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')"""
KEY = re.compile(rf"^\s*({BARE_OR_QUOTED}(?:\s*\.\s*{BARE_OR_QUOTED})*)\s*=")


def key_lines(text: str) -> dict[tuple, int]:
    """Line of every table header and key: {("server", "port"): 12, ("daemon", 1, "device"): 20}."""
    lines: dict[tuple, int] = {}
    table: tuple = ()
    arrays: dict[tuple, int] = {}
    open_quote = None
    for number, line in enumerate(text.splitlines(), 1):
        if open_quote:                       # inside a multi-line string
            if line.count(open_quote) % 2:
                open_quote = None
            continue
        if header := HEADER.match(line):
            name = _dotted(header[2])
            if header[1] == "[[":
                arrays[name] = arrays.get(name, -1) + 1
                table = name + (arrays[name],)
            else:
                table = name
            lines.setdefault(table, number)
        elif key := KEY.match(line):
            lines.setdefault(table + _dotted(key[1]), number)
            rest = line[key.end():]
            open_quote = next((quote for quote in ('"""', "'''") if rest.count(quote) % 2), None)
    return lines


def line_of(lines: dict[tuple, int], where: tuple) -> int | None:
    """The line of `where`, else of the nearest enclosing table or dotted key."""
    for end in range(len(where), 0, -1):
        if where[:end] in lines:
            return lines[where[:end]]
    return None


def _dotted(name: str) -> tuple[str, ...]:
    return tuple(part.strip().strip("\"'") for part in re.findall(rf"{BARE_OR_QUOTED}", name))
