"""Routing counts per (layer, expert): gathered by `moerun profile`, read by the planner
through `--hotness`. The CSV format is in docs/planner.md.

Shape legend: L layers, E experts, T tokens, K experts per token.
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np

from moerun.errors import UsageError
from moerun.models.spec import ModelSpec

HEADER = ["layer", "expert", "count"]


class HotnessError(UsageError):
    """A routing-count file that does not fit the model."""


class RoutingCounter:
    """Counts how often each expert is routed to, over everything the model runs."""

    def __init__(self, spec: ModelSpec):
        self.counts = np.zeros((spec.n_layers, spec.n_experts), np.int64)    # [L, E]

    def add(self, layer: int, ids: np.ndarray) -> None:
        """ids [T, K] of one MoE layer call."""
        self.counts[layer] += np.bincount(ids.ravel(), minlength=self.counts.shape[1])


def write_hotness(path: str | Path, counts: np.ndarray, spec: ModelSpec) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(HEADER)
    for layer, is_moe in enumerate(spec.moe_layers):
        if is_moe:
            writer.writerows([layer, expert, int(count)] for expert, count in enumerate(counts[layer]))
    Path(path).write_text(buffer.getvalue())


def read_hotness(path: str | Path, spec: ModelSpec) -> np.ndarray:
    """counts [L, E] from a hotness CSV; rows not given count 0."""
    path = Path(path)
    counts = np.zeros((spec.n_layers, spec.n_experts), np.int64)
    try:
        rows = list(csv.reader(path.read_text().splitlines()))
    except (OSError, UnicodeDecodeError) as err:
        raise HotnessError(f"{path}: cannot read routing counts: {err}") from None
    if not rows or rows[0] != HEADER:
        raise HotnessError(f"{path}: not a routing-count file (the first line must be {','.join(HEADER)})")
    for line, row in enumerate(rows[1:], start=2):
        try:
            layer, expert, count = (int(field) for field in row)
        except ValueError:
            raise HotnessError(f"{path}:{line}: expected three integers layer,expert,count") from None
        if not (0 <= layer < spec.n_layers and spec.moe_layers[layer]) or not 0 <= expert < spec.n_experts \
                or count < 0:
            raise HotnessError(f"{path}:{line}: layer {layer}, expert {expert}, count {count} does not fit "
                               f"this model ({spec.n_layers} layers, {spec.n_experts} experts)")
        counts[layer, expert] = count
    return counts
