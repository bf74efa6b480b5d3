"""The seam between the forward pass and wherever the routed experts run.

The forward pass calls its executor once per MoE layer: `begin(layer, x, ids, weights)`
starts the layer's routed-expert work and returns a pending result at once (a rig sends the
daemons their share first), the pass computes the shared expert meanwhile, and
`pending.finish()` gives the layer's routed output; given a `residual` (a layer without a
shared expert), the output already holds it (added by the kernel that writes it, all local).
Two implementations: LocalExecutor (every expert on the parent's backend) and the rig's
dispatchers (moerun.rig), which add expert daemons.

Shape legend: T tokens, H hidden, K experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from moerun.backends.protocol import Array, Experts


@dataclass
class RemoteCounts:
    """What an executor counts of the pairs that left the parent."""
    remote_layer_calls: int = 0        # MoE layer calls that sent some pair to a daemon
    remote_pairs: int = 0              # routed pairs sent to a daemon
    fallback_pairs: int = 0            # of those, computed by the parent after a daemon failed
    host_pairs: int = 0                # routed pairs to experts homed in host RAM (on CPU daemons), GPU parent
    cache_hits: int = 0                # of those, computed from the parent's expert cache
    streamed_pairs: int = 0            # of those, computed by the parent from a streamed layer
    read_pairs: int = 0                # of those, computed by the parent reading the weights in host RAM in place
    cache_swaps: int = 0               # experts copied into the expert cache
    cache_bytes_in: int = 0            # their bytes
    streamed_layers: int = 0           # prefill layer calls that streamed their host experts
    streamed_bytes: int = 0            # bytes copied for them


@dataclass
class MoEStats:
    moe_layer_calls: int = 0
    hot_only_layer_calls: int = 0      # layers whose routed experts all ran on the parent
    routed_pairs: int = 0              # (token, expert) pairs routed
    remote_pairs: int = 0              # of those, sent to a daemon
    fallback_pairs: int = 0            # of those, computed by the parent after a daemon failed
    host: RemoteCounts = field(default_factory=RemoteCounts)   # the host-RAM experts' counts (GPU parent)

    @classmethod
    def of(cls, moe_layer_calls: int, routed_pairs: int, remote: RemoteCounts) -> MoEStats:
        return cls(moe_layer_calls, moe_layer_calls - remote.remote_layer_calls, routed_pairs,
                   remote.remote_pairs, remote.fallback_pairs, remote)

    def to_dict(self) -> dict:
        host = self.host
        return {
            "moe_layer_calls": self.moe_layer_calls, "hot_only_layer_calls": self.hot_only_layer_calls,
            "hot_only_layer_share": self.hot_only_layer_calls / self.moe_layer_calls if self.moe_layer_calls else 0.0,
            "routed_pairs": self.routed_pairs, "remote_pairs": self.remote_pairs,
            "remote_pair_share": self.remote_pairs / self.routed_pairs if self.routed_pairs else 0.0,
            "fallback_pairs": self.fallback_pairs,
            "host_pairs": host.host_pairs, "cache_hits": host.cache_hits,
            "cache_hit_rate": host.cache_hits / host.host_pairs if host.host_pairs else 0.0,
            "cache_swaps": host.cache_swaps, "cache_bytes_in": host.cache_bytes_in,
            "streamed_pairs": host.streamed_pairs, "read_pairs": host.read_pairs,
            "streamed_layers": host.streamed_layers,
            "streamed_bytes": host.streamed_bytes,
        }


class Pending(Protocol):
    def finish(self) -> Array:
        """The layer's routed-expert output [T, H]."""


class ExpertExecutor(Protocol):
    def begin(self, layer: int, x: Array, ids: Array, weights: Array, residual: Array | None = None) -> Pending:
        """Start a MoE layer's routed experts: x [T, H], global expert ids and weights [T, K];
        the pending output is residual [T, H] + the routed output when residual is given."""

    def graph_key(self) -> tuple | None:
        """What a captured decode step depends on; None: the step must run eagerly."""

    def counts(self) -> RemoteCounts:
        """The pairs that left the parent so far (may wait for the device)."""


@dataclass
class Done:
    out: Any

    def finish(self) -> Any:
        return self.out


class LocalExecutor:
    """Every routed expert on the parent's backend: global ids are its local ids."""

    def __init__(self, experts: Experts):
        self.experts = experts

    def begin(self, layer: int, x: Array, ids: Array, weights: Array, residual: Array | None = None) -> Done:
        return Done(self.experts.compute(layer, x, ids, weights, residual=residual))

    def graph_key(self) -> tuple:
        return ()

    def counts(self) -> RemoteCounts:
        return RemoteCounts()
