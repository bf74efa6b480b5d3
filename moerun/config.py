"""Rig config files: TOML whose keys are moerun's flags (docs/config.md).

load_config_file() checks every key and value and returns the values by the name of the
command parameter each one sets; a command fills the flags not given on its command line
from them. An unknown key or a bad value is a ConfigError naming the key and its line.
"""
from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moerun.backends.devices import DEVICE_PATTERN
from moerun.ipc.protocol import MAX_BATCH_CAPACITY, PAYLOAD_DTYPES
from moerun.ipc.sockets import ENDPOINT
from moerun.rig.settings import AUTO, MODES, RIG_TRANSPORTS, ConfigError, DaemonEntry
from moerun.units import parse_bytes

WORKLOADS = ("generate", "serve")
DAEMON_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


# -- value checks: each returns the value as the parameter takes it, or raises ValueError ------

def text(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    return value


def any_text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("must be a string")
    return value


def boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def integer(low: int | None = None, high: int | None = None) -> Callable[[object], int]:
    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("must be an integer")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f">= {low}"
            raise ValueError(f"must be {bounds}")
        return value
    return check


def number(above: float | None = None) -> Callable[[object], float]:
    def check(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("must be a number")
        if above is not None and value <= above:
            raise ValueError(f"must be > {above:g}")
        return float(value)
    return check


def one_of(*choices: str) -> Callable[[object], str]:
    def check(value: object) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value
    return check


def matching(pattern: re.Pattern, what: str) -> Callable[[object], str]:
    def check(value: object) -> str:
        if not isinstance(value, str) or not pattern.match(value):
            raise ValueError(f"must be {what}")
        return value
    return check


def size(value: object) -> str:
    try:
        parse_bytes(text(value), "size")
    except ValueError:
        raise ValueError("must be a size such as 24GiB, 512MiB or 64GB") from None
    return value


device = matching(DEVICE_PATTERN, "cpu, cuda:N or hip:N")
endpoint = matching(ENDPOINT, "ipc://PATH or tcp://HOST:PORT")


@dataclass(frozen=True)
class Key:
    """A key sets the parameter of its own name (the flag with - for _)."""
    check: Callable[[object], object]
    path: bool = False           # a file name, relative to the config file's directory (~ expanded)


TOP_LEVEL = {
    "model": Key(text, path=True),
    "device": Key(device),
    "graphs": Key(boolean),
    "memory": Key(size),
    "workload": Key(one_of(*WORKLOADS)),
    "placement": Key(text, path=True),
    "hot": Key(integer(0)),
    "transport": Key(one_of(*RIG_TRANSPORTS)),
    "mode": Key(one_of(*MODES)),
    "payload_dtype": Key(one_of(*PAYLOAD_DTYPES)),
    "batch_capacity": Key(integer(1, MAX_BATCH_CAPACITY)),
    "daemon_timeout": Key(number(above=0)),
    "require_daemons": Key(boolean),
    "ctx": Key(integer(1)),
    "kv_pool": Key(integer(1)),
    "ubatch": Key(integer(1)),
}
TABLES = {
    "auth": {
        "client_secret_key": Key(text, path=True),
    },
    "generate": {
        "prompt": Key(any_text),
        "chat": Key(boolean),
        "n_predict": Key(integer(0)),
        "temp": Key(number()),
        "top_k": Key(integer(0)),
        "top_p": Key(number()),
        "min_p": Key(number()),
        "repeat_penalty": Key(number()),
        "repeat_last_n": Key(integer(0)),
        "seed": Key(integer()),
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
}
TOP_LEVEL_NAMES = (*TOP_LEVEL, *TABLES, "daemon")


def load_config_file(path: str | Path) -> dict[str, object]:
    """The file's values by parameter name: model, ctx, prompt, port, ... as the flags take
    them, plus `daemons` (the --daemon specs), `daemon_entries` (their [[daemon]] tables),
    `client_secret_key`, `workload` and `memory`. Keys the file leaves out are absent."""
    return _Reader(Path(path)).read()


class _Reader:
    def __init__(self, path: Path):
        self.path = path
        self.lines: dict[tuple, int] = {}

    def read(self) -> dict[str, object]:
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
                values.update(self._table((name,), self._as_table(name, value), TABLES[name]))
            elif name == "daemon":
                entries = self._daemons(value)
                values["daemons"] = tuple(entry.spec for entry in entries)
                values["daemon_entries"] = entries
            elif name in TOP_LEVEL:
                values.update(self._table((), {name: value}, TOP_LEVEL))
            else:
                raise self.error((name,), f"unknown key {name!r}{_suggestion(name, TOP_LEVEL_NAMES)}")
        if "hot" in values and "placement" in values:
            raise self.error(("placement",), "give hot or placement, not both")
        for index, entry in enumerate(values.get("daemon_entries", ())):
            if entry.curve_public_key and "client_secret_key" not in values:
                raise self.error(("daemon", index, "curve_public_key"),
                                 f"[[daemon]] {entry.name}: curve_public_key needs [auth] client_secret_key")
        return values

    def _table(self, where: tuple, table: dict, keys: dict[str, Key]) -> dict[str, object]:
        values = {}
        for name, value in table.items():
            key = keys.get(name)
            if key is None:
                raise self.error(where + (name,), f"unknown key {name!r}{_in(where)}{_suggestion(name, keys)}")
            try:
                checked = key.check(value)
            except ValueError as err:
                raise self.error(where + (name,), f"{name} = {value!r}: {err}") from None
            if key.path and not (name == "placement" and checked == AUTO):
                checked = str(self.path.parent.absolute() / Path(checked).expanduser())
            values[name] = checked
        return values

    def _daemons(self, value: object) -> tuple[DaemonEntry, ...]:
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise self.error(("daemon",), "daemon must be a list of [[daemon]] tables")
        entries = []
        for index, table in enumerate(value):
            where = ("daemon", index)
            fields = {"name": f"d{index}", **self._table(where, table, DAEMON)}
            entry = DaemonEntry(**fields)
            if entry.spec is None:
                raise self.error(where, f"[[daemon]] {entry.name} needs a device, an endpoint or both")
            if entry.listen and not (entry.endpoint and entry.device):
                raise self.error(where + ("listen",), f"[[daemon]] {entry.name}: listen needs a device and an endpoint")
            if (entry.curve_secret_key is None) != (entry.curve_authorized_keys is None):
                raise self.error(where, f"[[daemon]] {entry.name}: curve_secret_key and curve_authorized_keys "
                                        f"go together")
            if entry.name in (other.name for other in entries):
                raise self.error(where + ("name",), f"two [[daemon]] tables are named {entry.name!r}")
            entries.append(entry)
        return tuple(entries)

    def _as_table(self, name: str, value: object) -> dict:
        if not isinstance(value, dict):
            raise self.error((name,), f"{name} must be a table ([{name}])")
        return value

    def error(self, where: tuple, message: str) -> ConfigError:
        line = line_of(self.lines, where)
        return ConfigError(f"{self.path}{f', line {line}' if line else ''}: {message}")


def _in(where: tuple) -> str:
    return f" in [[{where[0]}]]" if len(where) == 2 else f" in [{where[0]}]" if where else ""


def _suggestion(name: str, keys) -> str:
    close = difflib.get_close_matches(name, keys, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
