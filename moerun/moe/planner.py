"""The planner: where every routed expert lives and how much KV cache the parent reserves.

`plan` is a pure function of the model's byte sizes, the devices' memory, the context and KV
settings and optional routing counts; it touches no device and reads no file. `model_sizes`
builds its model input from a GGUF tensor index. The rules are written down in docs/planner.md.

Shape legend: L layers, E experts, K experts per token, D daemons.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np

from moerun.backends.kv_types import KVTypes
from moerun.errors import UsageError
from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec
from moerun.moe.placement import PARENT, Placement
from moerun.units import format_bytes

EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(?:gate|up|down|gate_up)_exps\.weight")
UNPLACED = -2


class PlanError(UsageError):
    """The model does not fit the rig as asked; the message names the numbers and the flag to change."""


@dataclass(frozen=True)
class ModelSizes:
    n_layers: int                  # L
    n_experts: int                 # E
    n_experts_used: int            # K
    moe_layers: tuple[bool, ...]   # [L]
    expert_bytes: tuple[int, ...]  # [L] bytes of one routed expert (all its tensors); 0 on dense layers
    non_expert_bytes: int          # every other tensor: embeddings, attention, norms, routers, shared/dense FFNs, head
    kv_values_per_token: tuple[int, int]  # key and value elements of one position over all attention layers
    state_bytes: int = 0           # a sequence's recurrent states (f32) over all DeltaNet layers, whatever its length

    def kv_token_bytes(self, types: KVTypes) -> int:
        """Bytes one position adds to the KV cache in `types`."""
        return types.token_bytes(*self.kv_values_per_token)


@dataclass(frozen=True)
class DeviceBudget:
    name: str                      # "parent", or the daemon spec ("cuda:1", "cpu", "tcp://host:7070")
    capacity_bytes: int
    is_parent: bool = False


@dataclass(frozen=True)
class PlanRequest:
    sizes: ModelSizes
    parent: DeviceBudget
    daemons: tuple[DeviceBudget, ...]          # in --daemon order: a daemon's index is its position
    context: int                               # tokens
    kv_types: KVTypes = KVTypes("f16", "f16")
    kv_pool: int | None = None                 # bounded KV pool in tokens; None = no pool
    routing_counts: np.ndarray | None = None   # [L, E] routed pairs from `moerun profile`; None = uniform
    safety_bytes: int = 512 << 20
    workspace_bytes: int = 256 << 20
    expert_cache_bytes: int = 0                # the parent's expert cache (--expert-cache), reserved on it
    streams: bool = False                      # a GPU parent that streams the experts placed elsewhere
    stream_scratch_bytes: int = 0              # what plan() reserves for the streaming buffers (it sets this)


@dataclass(frozen=True)
class DeviceReport:
    name: str
    capacity_bytes: int
    reserved_bytes: int            # what is not for experts: non-expert weights, KV, workspace, safety margin
    budget_bytes: int              # what experts may use: capacity - reserved (never below 0)
    used_bytes: int                # what the experts placed here use
    n_experts: int
    traffic_share: float           # share of all routed pairs that these experts take


@dataclass(frozen=True)
class Plan:
    placement: Placement
    kv_reserved_tokens: int
    kv_reserved_bytes: int
    kv_types: KVTypes
    kv_rule: str                   # which rule decided the KV reservation, in words
    pool_redundant: bool           # a pool was set, yet full-context KV and every expert fit on the parent
    devices: tuple[DeviceReport, ...]  # the parent, then the daemons in order


def model_sizes(gguf: GGUFFile, spec: ModelSpec) -> ModelSizes:
    """Byte sizes of one expert per layer, of everything else, and of KV per token, from the tensor index."""
    expert_tensor_bytes = [0] * spec.n_layers
    non_expert_bytes = 0
    for info in gguf.tensors.values():
        if match := EXPERT_TENSOR.fullmatch(info.name):
            expert_tensor_bytes[int(match[1])] += info.nbytes
        else:
            non_expert_bytes += info.nbytes
    return ModelSizes(
        n_layers=spec.n_layers,
        n_experts=spec.n_experts,
        n_experts_used=spec.n_experts_used,
        moe_layers=spec.moe_layers,
        expert_bytes=tuple(nbytes // spec.n_experts for nbytes in expert_tensor_bytes),
        non_expert_bytes=non_expert_bytes,
        kv_values_per_token=kv_values_per_token(spec),
        state_bytes=recurrent_state_bytes(spec) * sum(spec.recurrent_layers),
    )


def kv_values_per_token(spec: ModelSpec) -> tuple[int, int]:
    """Key and value elements a position adds to the cache over all attention layers."""
    heads = spec.attention_layers * spec.n_kv_heads
    return heads * spec.head_dim_k, heads * spec.head_dim_v


def recurrent_state_bytes(spec: ModelSpec) -> int:
    """One DeltaNet layer's states of one sequence, f32: the recurrent [HV, DK, DV] and the
    convolution's last W-1 inputs [W-1, C]; 0 for a model without such layers."""
    shape = spec.delta_net
    if shape is None:
        return 0
    return 4 * (shape.value_heads * shape.key_dim * shape.value_dim + (shape.conv_kernel - 1) * shape.channels)


def streaming_buffer_bytes(sizes: ModelSizes, placement: Placement) -> int:
    """Prefill streaming's two buffers for `placement`: twice the largest layer's experts placed
    off the parent."""
    return 2 * max((int(np.count_nonzero(homes != PARENT)) * sizes.expert_bytes[layer]
                    for layer, homes in placement.homes.items()), default=0)


def plan(request: PlanRequest) -> Plan:
    """Choose the KV reservation and a home for every routed expert (rules: docs/planner.md).
    A parent that streams reserves the buffers its placement needs: planned again with them until
    the reservation covers them (each round can only move more experts off the parent)."""
    if not request.streams:
        return _plan(request)
    reserved = 0
    while True:
        result = _plan(replace(request, stream_scratch_bytes=reserved))
        needed = streaming_buffer_bytes(request.sizes, result.placement)
        if needed <= reserved:
            return result
        reserved = needed


def _plan(request: PlanRequest) -> Plan:
    _check(request)
    weights = _traffic_weights(request)
    context, pool = request.context, request.kv_pool
    if pool is None:
        return _report(request, weights, _place(request, weights, context), "full context", False)
    if pool >= context:
        placed = _place(request, weights, context)
        rule = f"pool >= context: full context (a pool of {pool} tokens is no reduction)"
        return _report(request, weights, placed, rule, placed.all_on_parent)
    return _report(request, weights, *_bounded_pool(request, weights))


def _bounded_pool(request: PlanRequest, weights: np.ndarray) -> tuple[_Placed, str, bool]:
    """pool < context: reserve for the pool only if full-context KV would push experts off the parent."""
    context, pool = request.context, request.kv_pool
    try:
        full = _place(request, weights, context)
    except PlanError:
        return _place(request, weights, pool), f"bounded pool: full-context KV ({context} tokens) does not fit", False
    if full.all_on_parent:
        return full, "full context: it fits with every expert on the parent", True
    try:
        pooled = _place(request, weights, pool)
    except PlanError:
        pooled = None
    if pooled is None or pooled.parent_key <= full.parent_key:
        return full, f"full context: a pool of {pool} tokens keeps no more experts on the parent", False
    pushed = sum(np.count_nonzero((pooled.homes[layer] == PARENT) & (full.homes[layer] != PARENT))
                 for layer in full.homes)
    experts = "expert" if pushed == 1 else "experts"
    return pooled, f"bounded pool: full context would push {pushed} {experts} off the parent", False


@dataclass(frozen=True)
class _Placed:
    kv_tokens: int
    homes: dict[int, np.ndarray]       # MoE layer -> int16 [E]: PARENT or a daemon index
    reserved: tuple[int, ...]          # per device, parent first: bytes not for experts
    budgets: tuple[int, ...]           # per device, parent first: bytes experts may use
    parent_key: tuple[float, int]      # (routed traffic, experts) on the parent: larger is better

    @property
    def all_on_parent(self) -> bool:
        return all(np.all(homes == PARENT) for homes in self.homes.values())


def _place(request: PlanRequest, weights: np.ndarray, kv_tokens: int) -> _Placed:
    """Floor first, then the parent and the daemons, in order of traffic per byte, with KV for kv_tokens."""
    sizes = request.sizes
    moe = [layer for layer, is_moe in enumerate(sizes.moe_layers) if is_moe]
    parent_reserved = (sizes.non_expert_bytes + _kv_bytes(request, kv_tokens) + request.workspace_bytes
                       + request.safety_bytes + request.expert_cache_bytes + request.stream_scratch_bytes)
    daemon_reserved = request.workspace_bytes + request.safety_bytes
    parent_budget = request.parent.capacity_bytes - parent_reserved
    daemon_budgets = [max(0, daemon.capacity_bytes - daemon_reserved) for daemon in request.daemons]

    floor = min(sizes.n_experts_used, sizes.n_experts)
    floor_bytes = floor * sum(sizes.expert_bytes[layer] for layer in moe)
    if parent_budget < floor_bytes:
        raise PlanError(_floor_message(request, kv_tokens, parent_budget, floor, len(moe), floor_bytes))
    homes = {layer: np.full(sizes.n_experts, UNPLACED, np.int16) for layer in moe}
    for layer in moe:
        by_traffic = np.lexsort((np.arange(sizes.n_experts), -weights[layer]))  # ties: lower expert id
        homes[layer][by_traffic[:floor]] = PARENT

    parent_left = parent_budget - floor_bytes
    daemon_used = [0] * len(daemon_budgets)
    homeless = []
    for layer, expert in _by_traffic_per_byte(sizes, weights, homes):
        nbytes = sizes.expert_bytes[layer]
        if nbytes <= parent_left:
            homes[layer][expert] = PARENT
            parent_left -= nbytes
            continue
        room = [d for d, budget in enumerate(daemon_budgets) if daemon_used[d] + nbytes <= budget]
        if not room:
            homeless.append(nbytes)
            continue
        daemon = min(room, key=lambda d: (Fraction(daemon_used[d] + nbytes, daemon_budgets[d]), d))
        homes[layer][expert] = daemon
        daemon_used[daemon] += nbytes
    if homeless:
        raise PlanError(_homeless_message(request, homeless, parent_budget, daemon_budgets))

    on_parent = np.stack([homes[layer] == PARENT for layer in moe])  # [L_moe, E]
    parent_key = (float(weights[moe][on_parent].sum()), int(on_parent.sum()))
    reserved = (parent_reserved, *[daemon_reserved] * len(daemon_budgets))
    return _Placed(kv_tokens, homes, reserved, (parent_budget, *daemon_budgets), parent_key)


def _by_traffic_per_byte(sizes: ModelSizes, weights: np.ndarray, homes: dict[int, np.ndarray]):
    """(layer, expert) not yet placed, highest routing count per byte first; ties by (layer, expert)."""
    unplaced = [(layer, int(expert)) for layer, row in homes.items() for expert in np.flatnonzero(row == UNPLACED)]
    return sorted(unplaced, key=lambda item: (-Fraction(float(weights[item])) / sizes.expert_bytes[item[0]], item))


def _traffic_weights(request: PlanRequest) -> np.ndarray:
    """[L, E] float64 routing counts, ones when none were given, zero on dense layers."""
    sizes = request.sizes
    counts = request.routing_counts
    weights = np.ones((sizes.n_layers, sizes.n_experts)) if counts is None else np.asarray(counts, np.float64)
    return weights * np.array(sizes.moe_layers, bool)[:, None]


def _report(request: PlanRequest, weights: np.ndarray, placed: _Placed, rule: str, pool_redundant: bool) -> Plan:
    moe = list(placed.homes)
    homes = np.stack([placed.homes[layer] for layer in moe])                                  # [L_moe, E]
    moe_weights = weights[moe]                                                                # [L_moe, E]
    expert_bytes = np.array([request.sizes.expert_bytes[layer] for layer in moe], np.int64)[:, None]
    devices = []
    all_homes = [PARENT, *range(len(request.daemons))]
    for position, (home, device) in enumerate(zip(all_homes, [request.parent, *request.daemons], strict=True)):
        here = homes == home
        devices.append(DeviceReport(
            name=device.name,
            capacity_bytes=device.capacity_bytes,
            reserved_bytes=placed.reserved[position],
            budget_bytes=max(0, placed.budgets[position]),
            used_bytes=int((expert_bytes * here).sum()),
            n_experts=int(here.sum()),
            traffic_share=float(moe_weights[here].sum() / moe_weights.sum()),
        ))
    return Plan(
        placement=Placement(placed.homes, tuple(daemon.name for daemon in request.daemons)),
        kv_reserved_tokens=placed.kv_tokens,
        kv_reserved_bytes=_kv_bytes(request, placed.kv_tokens),
        kv_types=request.kv_types,
        kv_rule=rule,
        pool_redundant=pool_redundant,
        devices=tuple(devices),
    )


def explain(plan: Plan) -> str:
    """The table `moerun plan` prints: per device bytes, experts and traffic share; the KV rule; the pool."""
    header = ("device", "capacity", "reserved", "expert budget", "expert bytes", "experts", "traffic")
    rows = [(d.name, format_bytes(d.capacity_bytes), format_bytes(d.reserved_bytes), format_bytes(d.budget_bytes),
             format_bytes(d.used_bytes),
             str(d.n_experts), f"{100 * d.traffic_share:.1f}%") for d in plan.devices]
    name_width = max(len(row[0]) for row in [header, *rows])
    lines = [f"{row[0]:<{name_width}}" + "".join(f"{cell:>14}" for cell in row[1:]) for row in [header, *rows]]
    lines.append(f"KV cache: {plan.kv_reserved_tokens} tokens at {plan.kv_types.label} "
                 f"({format_bytes(plan.kv_reserved_bytes)}) reserved on the parent; rule: {plan.kv_rule}")
    if plan.pool_redundant:
        lines.append("The bounded KV pool is redundant: full-context KV and every expert fit on the parent; "
                     "--kv-pool can be left out.")
    return "\n".join(lines)


def _check(request: PlanRequest) -> None:
    sizes = request.sizes
    if request.context < 1 or (request.kv_pool is not None and request.kv_pool < 1):
        raise PlanError(f"context ({request.context}) and KV pool ({request.kv_pool}) must be at least 1 token")
    if not request.parent.is_parent or any(daemon.is_parent for daemon in request.daemons):
        raise PlanError("exactly the parent's DeviceBudget has is_parent=True")
    if not any(sizes.moe_layers) or any(sizes.expert_bytes[layer] <= 0
                                        for layer, is_moe in enumerate(sizes.moe_layers) if is_moe):
        raise PlanError("the model needs at least one MoE layer, and every MoE layer a positive expert size")
    counts = request.routing_counts
    if counts is None:
        return
    counts = np.asarray(counts)
    if counts.shape != (sizes.n_layers, sizes.n_experts):
        raise PlanError(f"routing counts have shape {counts.shape}, the model needs "
                        f"({sizes.n_layers}, {sizes.n_experts}) (layers, experts)")
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise PlanError("routing counts must be finite and not negative")
    if not counts[np.array(sizes.moe_layers, bool)].sum() > 0:
        raise PlanError("routing counts hold no routed pairs on the MoE layers; profile a longer prompt "
                        "or plan without counts")


def _kv_bytes(request: PlanRequest, tokens: int) -> int:
    """The KV cache of `tokens` and the recurrent states of one sequence."""
    return request.sizes.kv_token_bytes(request.kv_types) * tokens + request.sizes.state_bytes


def _floor_message(request: PlanRequest, kv_tokens: int, parent_budget: int, floor: int, n_moe: int,
                   floor_bytes: int) -> str:
    sizes = request.sizes
    short = floor_bytes - parent_budget
    return (f"the parent ({format_bytes(request.parent.capacity_bytes)}) cannot hold the non-expert weights "
            f"({format_bytes(sizes.non_expert_bytes)}), KV for {kv_tokens} tokens at {request.kv_types.label} "
            f"({format_bytes(_kv_bytes(request, kv_tokens))}), workspace ({format_bytes(request.workspace_bytes)}), "
            f"safety margin ({format_bytes(request.safety_bytes)}){_extras(request)} "
            f"and the floor of {floor} experts in "
            f"each of {n_moe} MoE layers ({format_bytes(floor_bytes)}): {format_bytes(short)} ({short:,} bytes) short. "
            f"Lower --ctx, set --kv-pool, use smaller KV types (--kv-dtype, -ctk/-ctv), or use a parent device "
            f"with more memory.")


def _extras(request: PlanRequest) -> str:
    """The expert cache and streaming buffers in a list of reservations, if any."""
    return "".join(f", {what} ({format_bytes(nbytes)})" for what, nbytes in (
        ("expert cache", request.expert_cache_bytes),
        ("prefill streaming buffers (--stream-threshold off: none)", request.stream_scratch_bytes)) if nbytes)


def _homeless_message(request: PlanRequest, homeless: list[int], parent_budget: int,
                      daemon_budgets: list[int]) -> str:
    missing = sum(homeless)
    budgets = ", ".join(f"{daemon.name} {format_bytes(budget)}"
                        for daemon, budget in zip(request.daemons, daemon_budgets, strict=True))
    return (f"{len(homeless)} experts ({format_bytes(missing)}, {missing:,} bytes) have no room: the parent's expert "
            f"budget ({format_bytes(parent_budget)}) and the daemons' ({budgets or 'no --daemon given'}) are full. "
            f"Add a --daemon, or free parent memory (lower --ctx, set --kv-pool, use smaller KV types: --kv-dtype, "
            f"-ctk/-ctv).")

