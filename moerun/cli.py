"""The `moerun` command line: the group, and each command from its module in moerun.commands."""
from __future__ import annotations

import signal

import click

from moerun.commands.bench import bench
from moerun.commands.daemon import daemon
from moerun.commands.inspect import inspect
from moerun.commands.keys import keys
from moerun.commands.launch import launch
from moerun.commands.logits import logits
from moerun.commands.plan import plan
from moerun.commands.profile import profile
from moerun.commands.run import run
from moerun.commands.serve import serve
from moerun.commands.systemd import systemd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moerun")
def main() -> None:
    """Run Mixture-of-Experts LLMs from GGUF files."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C does, so daemons and shared memory are released."""
    raise SystemExit(128 + signum)


for command in (run, logits, inspect, daemon, profile, plan, serve, launch, systemd, keys, bench):
    main.add_command(command)
