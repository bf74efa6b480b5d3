"""What a compute backend offers: weights in its own form, a sequence's KV cache, the
operations of one forward pass, routed experts, and a way to run a step. Pure compute: a
backend knows nothing of models, runtimes or rigs. numpy_backend.NumpyBackend is the plainest
statement of each operation; gpu.backend.GpuBackend does the same with kernels.

Shape legend: T tokens, H hidden, N output rows, V vocab, NH/NKV heads, D/Dv head dims,
E experts, K experts per token.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from moerun.backends.kv_types import KVTypes
from moerun.errors import MoerunError
from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec

Array = Any          # the backend's array: numpy on the CPU, CuPy on a GPU
Forward = Callable[[Array, Array], Array]     # (ids [T], positions [T]) -> logits [T or 1, V]


class ContextFull(MoerunError):
    """The sequence would grow past the positions its KV cache was sized for."""

    def __init__(self, needed: int, capacity: int):
        super().__init__(f"the sequence needs {needed} positions but the context holds {capacity}")


@dataclass
class RecurrentStates:
    """Copies of a cache's DeltaNet layer states at one position, on the cache's device: conv
    [W-1, C] and ssm [HV, DK, DV] by layer (empty dicts for a model without DeltaNet layers)."""
    conv: dict[int, Any] = field(default_factory=dict)
    ssm: dict[int, Any] = field(default_factory=dict)


class KVCache(Protocol):
    capacity: int                 # positions it can hold
    length: int                   # positions it holds

    def reserve(self, n_tokens: int) -> None: ...   # room for n more, or ContextFull

    def advance(self, n_tokens: int) -> None: ...   # n more positions written

    def truncate(self, length: int) -> None: ...     # attention positions from `length` on dropped

    def recurrent_states(self) -> RecurrentStates: ...             # a copy of the DeltaNet layers' states

    def restore_recurrent(self, states: RecurrentStates) -> None: ...   # them again, in place

    def snapshot(self) -> CacheState: ...           # what resuming at `length` needs, on the host


@dataclass
class CacheState:
    """A cache's contents at one position, as host arrays: each attention layer's keys and
    values [S, NKV, D] and [S, NKV, Dv] (S = length; the cache's element type), each DeltaNet
    layer's conv [W-1, C] and recurrent [HV, DK, DV] states. A backend's restore_cache makes a
    cache of it again."""
    length: int
    keys: dict[int, np.ndarray] = field(default_factory=dict)
    values: dict[int, np.ndarray] = field(default_factory=dict)
    conv: dict[int, np.ndarray] = field(default_factory=dict)
    ssm: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for part in (self.keys, self.values, self.conv, self.ssm) for a in part.values())


class Experts(Protocol):
    """A model's routed experts on one backend: every expert of each MoE layer, or the ones a
    placement gave this process, numbered 0.. in ascending global id (their local ids)."""

    def compute(self, layer: int, x: Array, ids: Array, weights: Array, out: Array | None = None,
                residual: Array | None = None) -> Array:
        """out[t] = (residual[t] +) Σ_k weights[t, k] · FFN_{ids[t, k]}(x[t]) over the k with
        ids[t, k] >= 0 (local ids). x [T, H], ids/weights [T, K] -> [T, H], written into `out`
        when given."""


class Backend(Protocol):
    name: str                     # cpu | cuda:N | hip:N
    kind: str                     # CPU | CUDA | HIP
    spec: ModelSpec               # the model it runs
    kv_types: KVTypes             # its KV caches' elements (kv_types.py)
    captured_steps: int           # steps captured as CUDA graphs so far (0 where there are none)
    step_tokens: int              # the most tokens a captured step takes (0: steps run as they come)

    # -- weights, read while loading (between begin_loading and finish_loading)
    def begin_loading(self, gguf: GGUFFile) -> None: ...

    def finish_loading(self) -> None: ...

    def matrix(self, gguf: GGUFFile, name: str) -> Any: ...          # [N, K]

    def vector(self, values: np.ndarray) -> Array: ...               # f32 [N]

    def embedding(self, gguf: GGUFFile, name: str) -> Any: ...       # [V, H] rows looked up by embed()

    def load_experts(self, gguf: GGUFFile, held: dict[int, list[int]] | None, cache_bytes: int) -> Experts:
        """Every layer's routed experts (held None), or the `held` global ids per layer."""

    # -- sequences and steps
    cache_grows: bool             # its caches grow with the sequence (else they are allocated whole)

    def context_memory(self, ubatch: int) -> tuple[int, int]:
        """(bytes its device has free now for a sequence's cache, bytes of attention scratch per
        cached position a prefill chunk of `ubatch` tokens takes)."""

    def new_cache(self, capacity: int) -> KVCache: ...

    def restore_cache(self, state: CacheState, capacity: int) -> KVCache: ...   # a cache holding `state`

    def run_step(self, forward: Forward, inputs: np.ndarray, start: int, graph_key: tuple | None) -> np.ndarray:
        """forward() for host inputs — token ids [T], or a layer shard's hidden states f32 [T, H]
        — at positions start.. on this backend's arrays; its output comes back to the host as
        f32. With a graph_key, a step of at most step_tokens tokens (or one hidden state) may replay
        the device work captured for that key (CUDA graphs)."""

    def hop(self, x: Array, action: Callable[[np.ndarray], np.ndarray]) -> Array:
        """x [T, H] through a host action (the layer shards) and back: action(x on the host) ->
        [T, H], on this backend's arrays; inside a captured step the copies are part of the graph
        and the action runs between its segments."""

    def to_host(self, x: Array) -> np.ndarray: ...

    # -- the operations of a forward pass
    def embed(self, table: Any, ids: Array) -> Array: ...            # -> [T, H]

    def rms_norm(self, x: Array, weight: Array) -> Array: ...

    def linear(self, x: Array, weight: Any, bias: Array | None = None, residual: Array | None = None) -> Array:
        """x [T, K] · weight [N, K]ᵀ (+ bias [N]) (+ residual [T, N]) -> [T, N]"""

    def linears(self, x: Array, weights: tuple[Any, ...], biases: tuple[Array | None, ...],
                norm: Array | None = None) -> tuple[Array, ...]:
        """x through each weight (+ its bias), as linear does: q, k and v, in one launch where it
        can; with `norm`, rms_norm(x, norm) through them (a GPU folds the norm into the product)."""

    def swiglu_ffn(self, x: Array, ffn: tuple[Any, Any, Any], residual: Array | None = None) -> Array:
        """A SwiGLU FFN (gate [F, H], up [F, H], down [H, F]): down · (silu(gate · x) · up · x)
        (+ residual [T, H]) -> [T, H]; a shared expert, a dense layer's FFN."""

    def rope_append(self, q: Array, k: Array, v: Array, q_norm: Array | None, k_norm: Array | None,
                    cache: KVCache, layer: int, positions: Array) -> Array:
        """Per-head q/k norm (when given) and rope; k and v appended to the cache -> rotated q."""

    def attention(self, q: Array, cache: KVCache, layer: int, positions: Array) -> Array:
        """Causal attention of q over the cache -> [T, NH*Dv]"""

    def tree_attention(self, q: Array, cache: KVCache, layer: int, among: np.ndarray) -> Array:
        """q [T, NH, D] of a speculative tree's nodes (at the cache's next T rows) over the rows
        before them and the nodes `among` [T, T] marks -> [T, NH*Dv] (the CPU backend; a GPU's
        refuses)"""

    def route(self, x: Array, norm: Array, router: Any) -> tuple[Array, Array, Array]:
        """h = rms_norm(x [T, H], norm), the experts' input, and h through the router [E, H] ->
        (h, the top-K expert ids [T, K], their weights [T, K]), by the model's rule; a GPU
        computes all three in one launch where it can."""

    def silu_mul(self, gate: Array, up: Array) -> Array: ...

    def query_gate(self, q_gate: Array) -> tuple[Array, Array]:
        """Gated attention's q projection [T, NH*2D] (each head's query, then its gate) -> q, gate [T, NH*D]"""

    def sigmoid_gate(self, x: Array, gate: Array) -> Array: ...      # x · sigmoid(gate)

    def delta_net(self, channels: Array, z: Array, beta: Array, alpha: Array, weights: tuple[Array, ...],
                  cache: KVCache, layer: int) -> Array:
        """A gated DeltaNet layer from its projections (channels [T, C] = q, k, v before the
        causal conv; z [T, HV*DV]; beta, alpha [T, HV]) and weights (conv [C, W], a, dt [HV],
        norm [DV]), advancing the layer's conv and recurrent states in `cache` -> [T, HV*DV]"""

    def add(self, x: Array, y: Array, gate_logit: Array | None = None) -> Array:
        """x + y, or x + sigmoid(gate_logit [T, 1]) · y"""

    def concat(self, parts: list[Array]) -> Array:
        """Arrays of the same columns, their rows one after the other: the sequences of a batched step."""


def swiglu_by_products(backend: Backend, x: Array, ffn: tuple[Any, Any, Any], residual: Array | None = None) -> Array:
    """Backend.swiglu_ffn from the backend's products: gate and up in one linears call, SwiGLU, down
    adding the residual."""
    gate, up, down = ffn
    return backend.linear(backend.silu_mul(*backend.linears(x, (gate, up), (None, None))), down, residual=residual)
