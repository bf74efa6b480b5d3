"""Every error moerun raises on purpose derives from MoerunError (moerun/errors.py): the commands
turn exactly those into one `Error:` line; anything else is a bug and keeps its traceback."""
from __future__ import annotations

import importlib
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from moerun.commands.options import friendly_errors
from moerun.errors import MoerunError, UsageError

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"moerun": REPO / "moerun", "moerun.ipc": REPO / "ipc", "moerun.daemons": REPO / "daemons"}
# Exceptions that are signals between moerun's own parts, never shown to a user.
SIGNALS = {"moerun.backends.gpu.graphs.StepRetry", "moerun.gguf.chat._RaisedByTemplate"}


def exception_classes() -> list[str]:
    """module.Class of every exception class moerun's source defines (each module imported)."""
    found = []
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            name = ".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])
            if name.endswith("__main__"):
                continue
            module = importlib.import_module(name)
            found += [f"{name}.{cls.__name__}" for cls in vars(module).values()
                      if isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == module.__name__]
    return sorted(found)


CLASSES = exception_classes()


def test_the_scan_finds_the_errors():
    assert {"moerun.gguf.reader.GGUFError", "moerun.ipc.protocol.DaemonTimeout",
            "moerun.rig.settings.ConfigError", "moerun.backends.devices.GpuError"} <= set(CLASSES)


@pytest.mark.parametrize("name", [name for name in CLASSES if name not in SIGNALS])
def test_every_error_derives_from_moerun_error(name):
    module, _, cls = name.rpartition(".")
    assert issubclass(getattr(importlib.import_module(module), cls), MoerunError)


def run_raising(error: BaseException):
    @click.command()
    @friendly_errors
    def command():
        raise error
    return CliRunner().invoke(command)


def test_a_moerun_error_is_one_error_line():
    result = run_raising(UsageError("--threads: must be at least 1"))
    assert result.exit_code == 1
    assert result.output == "Error: --threads: must be at least 1\n"


def test_any_other_exception_keeps_its_traceback():
    result = run_raising(ValueError("a bug"))
    assert result.exit_code == 1
    assert isinstance(result.exception, ValueError)
