"""`moerun --help` and `--version` start at once: they import no command and nothing heavy, and a
command's own --help leaves out what only a bf16 payload needs (ml_dtypes, over a second of CPU)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moerun.cli import COMMANDS, main

HEAVY = ("numpy", "ml_dtypes", "zmq", "moerun.engine", "moerun.commands.run")


def modules_after(*args: str) -> set[str]:
    """The modules a fresh interpreter holds after `moerun ARGS`."""
    script = ("import sys, json\nfrom moerun.cli import main\n"
              f"try:\n    main({list(args)!r})\nexcept SystemExit:\n    pass\n"
              "print(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_the_group_imports_nothing_heavy(flag):
    loaded = modules_after(flag)
    assert not [name for name in HEAVY if name in loaded]


def test_a_commands_help_leaves_ml_dtypes_out():
    loaded = modules_after("run", "--help")
    assert "moerun.commands.run" in loaded and "ml_dtypes" not in loaded


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_groups_summary_is_the_commands_own(name):
    command = main.get_command(None, name)
    assert " ".join(command.help.split()).startswith(COMMANDS[name])


def test_an_unknown_command_is_named(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["frobnicate"])
    assert exit_.value.code == 2
    assert "No such command 'frobnicate'" in capsys.readouterr().err
