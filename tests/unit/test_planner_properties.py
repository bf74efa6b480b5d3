"""Properties of the planner over random model sizes, budgets, routing counts and pools."""
from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moerun.backends.kv_types import KVTypes
from moerun.moe.placement import PARENT
from moerun.moe.planner import DeviceBudget, ModelSizes, PlanError, PlanRequest, plan

SETTINGS = settings(max_examples=200, deadline=None)


@st.composite
def requests(draw) -> PlanRequest:
    n_layers = draw(st.integers(1, 5))
    n_experts = draw(st.integers(1, 10))
    moe_layers = draw(st.lists(st.booleans(), min_size=n_layers, max_size=n_layers).filter(any))
    expert_bytes = tuple(draw(st.integers(1, 400)) if is_moe else 0 for is_moe in moe_layers)
    kv_values = (32 * draw(st.integers(0, 2)), 32 * draw(st.integers(0, 2)))    # whole blocks of 32
    sizes = ModelSizes(
        n_layers=n_layers,
        n_experts=n_experts,
        n_experts_used=draw(st.integers(1, 4)),
        moe_layers=tuple(moe_layers),
        expert_bytes=expert_bytes,
        non_expert_bytes=draw(st.integers(0, 2000)),
        kv_values_per_token=kv_values,
    )
    counts = draw(st.none() | st.lists(st.integers(0, 50), min_size=n_layers * n_experts,
                                       max_size=n_layers * n_experts))
    if counts is not None:
        counts = np.array(counts).reshape(n_layers, n_experts)
        counts[moe_layers.index(True), 0] += 1  # at least one routed pair

    # capacities around what the model needs, so that plans fit, just fit or just fail
    kv_types = KVTypes(*[draw(st.sampled_from(["f16", "f32", "q8_0", "q4_0"]))] * 2)
    context = draw(st.integers(1, 200))
    fixed = draw(st.integers(0, 300)) + draw(st.integers(0, 300))
    all_experts = n_experts * sum(expert_bytes)
    floor = min(sizes.n_experts_used, n_experts) * sum(expert_bytes)
    parent_need = sizes.non_expert_bytes + sizes.kv_token_bytes(kv_types) * context + fixed + floor
    return PlanRequest(
        sizes=sizes,
        parent=DeviceBudget("parent", max(0, parent_need + draw(st.integers(-200, all_experts + 200))),
                            is_parent=True),
        daemons=tuple(DeviceBudget(f"cuda:{i}", max(0, fixed + draw(st.integers(-200, 2 * all_experts))))
                      for i in range(draw(st.integers(0, 3)))),
        context=context,
        kv_types=kv_types,
        kv_pool=draw(st.none() | st.integers(1, 2 * context)),
        routing_counts=counts,
        safety_bytes=fixed // 2,
        workspace_bytes=fixed - fixed // 2,
    )


def plan_or_none(request: PlanRequest):
    try:
        return plan(request)
    except PlanError:
        return None


@SETTINGS
@given(requests())
def test_every_expert_has_one_home_within_every_budget(request):
    result = plan_or_none(request)
    if result is None:
        return
    sizes = request.sizes
    homes = result.placement.homes
    assert sorted(homes) == [layer for layer, is_moe in enumerate(sizes.moe_layers) if is_moe]
    used = np.zeros(1 + len(request.daemons), np.int64)        # parent, then each daemon
    for layer, row in homes.items():
        assert row.shape == (sizes.n_experts,) and row.dtype == np.int16
        assert np.all((PARENT <= row) & (row < len(request.daemons)))
        assert np.count_nonzero(row == PARENT) >= min(sizes.n_experts_used, sizes.n_experts)
        np.add.at(used, row.astype(np.int64) + 1, sizes.expert_bytes[layer])

    kv_bytes = sizes.kv_token_bytes(request.kv_types) * result.kv_reserved_tokens
    fixed = request.workspace_bytes + request.safety_bytes
    budgets = [request.parent.capacity_bytes - sizes.non_expert_bytes - kv_bytes - fixed]
    budgets += [max(0, daemon.capacity_bytes - fixed) for daemon in request.daemons]
    assert np.all(used <= budgets)
    assert [d.used_bytes for d in result.devices] == used.tolist()
    assert [d.budget_bytes for d in result.devices] == budgets
    assert sum(d.n_experts for d in result.devices) == len(homes) * sizes.n_experts
    assert abs(sum(d.traffic_share for d in result.devices) - 1) < 1e-9


@SETTINGS
@given(requests())
def test_kv_reservation_follows_the_pool_rules(request):
    result = plan_or_none(request)
    if result is None:
        return
    context, pool = request.context, request.kv_pool
    assert result.kv_reserved_tokens in (context, pool)
    if pool is None or pool >= context:
        assert result.kv_reserved_tokens == context
    parent_holds_all = result.devices[0].n_experts == sum(d.n_experts for d in result.devices)
    assert result.pool_redundant == (pool is not None and result.kv_reserved_tokens == context and parent_holds_all)
    if result.kv_reserved_tokens != context:
        # the pool was reserved: full-context KV fails, or keeps less on the parent
        full = plan_or_none(dataclasses.replace(request, kv_pool=None))
        assert full is None or (full.devices[0].traffic_share, full.devices[0].n_experts) < \
                               (result.devices[0].traffic_share, result.devices[0].n_experts)


@SETTINGS
@given(requests(), st.integers(0, 6000))
def test_more_parent_memory_never_covers_less_traffic(request, extra):
    larger = dataclasses.replace(request, parent=DeviceBudget("parent", request.parent.capacity_bytes + extra,
                                                              is_parent=True))
    smaller_plan, larger_plan = plan_or_none(request), plan_or_none(larger)
    if smaller_plan is not None and larger_plan is not None:
        assert larger_plan.devices[0].traffic_share >= smaller_plan.devices[0].traffic_share - 1e-12


@SETTINGS
@given(requests())
def test_same_inputs_same_plan(request):
    copy = dataclasses.replace(request, routing_counts=None if request.routing_counts is None
                               else request.routing_counts.copy())
    first, second = plan_or_none(request), plan_or_none(copy)
    assert (first is None) == (second is None)
    if first is not None:
        assert first.placement.to_json() == second.placement.to_json()
        assert first.devices == second.devices and first.kv_rule == second.kv_rule
