"""The token ids of every forward pass a model runs, recorded through MoEModel.forward."""
from __future__ import annotations

from moerun.engine.model import MoEModel


def record_forward_calls(monkeypatch) -> list[list[int]]:
    """A list that each MoEModel.forward call appends its ids to, for the rest of the test."""
    calls: list[list[int]] = []
    forward = MoEModel.forward

    def recording_forward(self, ids, cache, all_logits):
        calls.append(list(ids))
        return forward(self, ids, cache, all_logits)

    monkeypatch.setattr(MoEModel, "forward", recording_forward)
    return calls
