"""The `moerun` command line: the group, and each command from its module in moerun.commands,
imported only when it runs (so `moerun --help` and `--version` start at once)."""
from __future__ import annotations

import importlib
import signal

import click

from moerun.commands.llama_flags import refuse_foreign_flags

# name -> the first sentence of its docstring, for `moerun --help` without importing it
COMMANDS = {
    "run": "Generate text, streaming it to stdout.",
    "logits": "Write float32 logits [T, vocab] for every position of a token sequence.",
    "inspect": "Print the architecture, hyper-parameters, tensor types and sizes of a GGUF model",
    "daemon": "Serve experts of MODEL to one parent at a time",
    "profile": "Count how often each expert is routed to over a set of prompts (for `plan --hotness`).",
    "plan": "Place every routed expert on the parent or a daemon within the devices' memory",
    "serve": "Serve the OpenAI chat and completions API over HTTP, with /health and /metrics.",
    "launch": "Start the rig a config file describes and run its workload.",
    "systemd": "Write systemd units for the daemons and the parent of a rig config.",
    "keys": "Make a CURVE key pair: NAME.key (public) and NAME.key_secret (secret, mode 0600).",
    "bench": "Measure prefill (pp) and decode (tg) tokens/s, printed as llama-bench prints them.",
    "batched-bench": "Measure several sequences prefilled and decoded together, printed as llama-batched-bench "
                     "prints them.",
}


class LazyGroup(click.Group):
    """A group whose commands are imported from moerun.commands.NAME when asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module = name.replace("-", "_")
        return getattr(importlib.import_module(f"moerun.commands.{module}"), module)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name, command, rest = super().resolve_command(ctx, args)
        refuse_foreign_flags(command, rest)
        return name, command, rest

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, summary) for name, summary in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moerun")
def main() -> None:
    """Run Mixture-of-Experts LLMs from GGUF files."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C does, so daemons and shared memory are released."""
    raise SystemExit(128 + signum)
