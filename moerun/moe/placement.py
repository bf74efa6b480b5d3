"""Where each routed expert lives: on the parent or on one of the daemons.

A placement maps every (layer, expert) of the MoE layers to a home: PARENT (-1) or
a daemon index 0..D-1 into the rig's `--daemon` list. The JSON file format is in
docs/placement.md.

Shape legend: L layers, E experts, D daemons.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moerun.errors import UsageError
from moerun.models.spec import ModelSpec

PARENT = -1
FORMAT = "moerun-placement/1"


class PlacementError(UsageError):
    """A placement that does not fit the model or the rig."""


@dataclass(frozen=True)
class Placement:
    homes: dict[int, np.ndarray]   # MoE layer -> int16 [E] of PARENT or a daemon index
    daemon_specs: tuple[str, ...]  # what each daemon index stands for (the --daemon specs)

    @property
    def n_daemons(self) -> int:
        return len(self.daemon_specs)

    def within(self, layers: range) -> Placement:
        """The placement of `layers` only (a parent whose later layers run on layer shards)."""
        return Placement({layer: homes for layer, homes in self.homes.items() if layer in layers}, self.daemon_specs)

    def experts_of(self, daemon: int) -> dict[int, list[int]]:
        """Global expert ids per layer that `daemon` holds, ascending; the position in
        each list is the daemon-local id."""
        return {layer: np.flatnonzero(homes == daemon).tolist() for layer, homes in self.homes.items()
                if np.any(homes == daemon)}

    def local_ids(self, layer: int, home: int) -> np.ndarray:
        """int32 [E]: each expert's local id at `home` (its position among that home's
        experts of the layer, as experts_of lists them), -1 for the experts elsewhere."""
        homes = self.homes[layer]
        local = np.full(len(homes), -1, np.int32)
        members = np.flatnonzero(homes == home)
        local[members] = np.arange(len(members))
        return local

    def to_json(self, fingerprint: str | None = None) -> str:
        """The placement file (docs/placement.md), one line per layer."""
        layers = ",\n".join(f'  "{layer}": {json.dumps(homes.tolist())}' for layer, homes in sorted(self.homes.items()))
        return (f'{{\n "format": "{FORMAT}",\n "fingerprint": {json.dumps(fingerprint)},\n'
                f' "daemons": {json.dumps(list(self.daemon_specs))},\n "layers": {{\n{layers}\n }}\n}}')


def hot_placement(spec: ModelSpec, hot: int, daemon_specs: list[str]) -> Placement:
    """--hot N: experts 0..N-1 of every MoE layer on the parent, the rest dealt
    round-robin to the daemons (all on the parent when there are none)."""
    homes = {}
    for layer, is_moe in enumerate(spec.moe_layers):
        if not is_moe:
            continue
        row = np.full(spec.n_experts, PARENT, np.int16)
        if daemon_specs:
            cold = np.arange(min(hot, spec.n_experts), spec.n_experts)
            row[cold] = np.arange(len(cold)) % len(daemon_specs)
        homes[layer] = row
    return Placement(homes, tuple(daemon_specs))


def load_placement(path: str | Path, spec: ModelSpec, daemon_specs: list[str], fingerprint: str) -> Placement:
    """Read a placement file and check it against the model and the --daemon list."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PlacementError(f"{path}: cannot read placement: {err}") from None

    def fail(problem: str):
        raise PlacementError(f"{path}: {problem}")

    if not isinstance(document, dict) or document.get("format") != FORMAT:
        fail(f"not a placement file (expected \"format\": \"{FORMAT}\")")
    if document.get("fingerprint") not in (None, fingerprint):
        fail("made for a different model file (fingerprint differs)")
    specs = document.get("daemons")
    if not isinstance(specs, list) or not all(isinstance(daemon, str) for daemon in specs):
        fail("\"daemons\" must list the daemons the placement was made for")
    if len(specs) != len(daemon_specs):
        fail(f"was made for {_daemon_list(specs)} but the rig has {_daemon_list(daemon_specs)}: give the "
             f"daemons it names, in that order, with --daemon (or [[daemon]] tables)")
    layers = document.get("layers")
    if not isinstance(layers, dict):
        fail("\"layers\" must map layer numbers to per-expert homes")
    moe_layers = {i for i, is_moe in enumerate(spec.moe_layers) if is_moe}
    homes = {}
    for key, row in layers.items():
        if not (key.isascii() and key.isdigit() and str(int(key)) == key) or int(key) not in moe_layers:
            fail(f"layer {key!r} is not a MoE layer of this model")
        if not isinstance(row, list) or len(row) != spec.n_experts or \
                not all(type(h) is int and PARENT <= h < len(specs) for h in row):
            fail(f"layer {key}: expected {spec.n_experts} homes, each -1 (parent) or a daemon index "
                 f"0..{len(specs) - 1}")
        homes[int(key)] = np.array(row, np.int16)
    if missing := sorted(moe_layers - homes.keys()):
        fail(f"no homes for MoE layers {missing}")
    return Placement(homes, tuple(daemon_specs))


def _daemon_list(specs) -> str:
    return f"{len(specs)} daemon{'' if len(specs) == 1 else 's'} ({', '.join(specs)})" if specs else "no daemon"
