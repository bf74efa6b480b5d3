"""llama.cpp's flags that moerun does not take, each refused with what to use instead.

Flags whose meaning is the same are aliases on the options themselves (-c, -t, -s, -f, -ub,
--ignore-eos, ...); these are the ones whose meaning differs. They are found before the command
parses its arguments, since click would read `-ngl 99` as `-n gl`.
"""
from __future__ import annotations

import click

MOERUN_PLACES = "moerun places layers and experts itself: see --device, --split and --hot (or --placement auto)"
FOREIGN_FLAGS = {
    **dict.fromkeys(("-ngl", "--n-gpu-layers", "--gpu-layers"), MOERUN_PLACES),
    **dict.fromkeys(("-ncmoe", "--n-cpu-moe", "-cmoe", "--cpu-moe"),
                    "experts in host RAM run on CPU expert daemons: --daemon cpu with --hot N (or --placement auto)"),
    **dict.fromkeys(("-ot", "--override-tensor"), "experts are placed by --hot N or --placement FILE|auto"),
    **dict.fromkeys(("-ts", "--tensor-split", "-sm", "--split-mode", "-mg", "--main-gpu"),
                    "the parent's device is --device; layer ranges go to other devices with --split SPEC@LAYER"),
    **dict.fromkeys(("-fa", "--flash-attn"), "moerun picks its attention kernels itself: leave the flag out"),
    **dict.fromkeys(("-b", "--batch-size"), "the prefill chunk is --ubatch (-ub)"),
    **dict.fromkeys(("-cnv", "--conversation", "-i", "--interactive"),
                    "moerun run --chat reads user turns from standard input"),
    **dict.fromkeys(("--mlock", "--no-mmap"), "moerun always maps the file: leave the flag out"),
    "--numa": "--pin holds the parent and its CPU daemons to CPUs of their own; a config's numa_node picks a node",
}


def refuse_foreign_flags(command: click.Command, args: list[str]) -> None:
    """A usage error for the first llama.cpp flag in `args` that `command` does not take, skipping
    the values of the options it does take."""
    takes_value = {name: not (param.is_flag or param.count)
                   for param in command.params if isinstance(param, click.Option)
                   for name in (*param.opts, *param.secondary_opts)}
    tokens = iter(args)
    for token in tokens:
        if token == "--":
            return
        name = token.split("=", 1)[0]
        if name in takes_value:
            if takes_value[name] and "=" not in token:
                next(tokens, None)
        elif name in FOREIGN_FLAGS:
            raise click.UsageError(f"{name} is a llama.cpp flag moerun does not take: {FOREIGN_FLAGS[name]}.")
