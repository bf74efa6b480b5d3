"""The pure rules behind prefill streaming and the expert cache: slots per layer, which experts
swap in, the automatic threshold, the flags, and what the planner reserves for them."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.moe.placement import PARENT
from moerun.moe.planner import DeviceBudget, ModelSizes, PlanError, PlanRequest, plan, streaming_buffer_bytes
from moerun.rig.gpu.expert_cache import DECAY, REFRESH_STEPS, cache_slots, choose_swaps, clearly_ahead
from moerun.rig.gpu.expert_stream import auto_threshold
from moerun.rig.gpu.host_experts import marked_runs
from moerun.rig.gpu.host_reads import spread
from moerun.rig.settings import AUTO, ConfigError, RigConfig

GiB = 1 << 30


def test_slots_go_round_the_layers_while_the_budget_lasts():
    assert cache_slots(5 * 100, {0: 100, 1: 100, 2: 100}, {0: 4, 1: 4, 2: 4}) == {0: 2, 1: 2, 2: 1}


def test_a_budget_below_one_expert_per_layer_gives_some_layers_a_slot():
    assert cache_slots(250, {0: 100, 1: 100, 2: 100, 3: 100}, {0: 8, 1: 8, 2: 8, 3: 8}) == {0: 1, 1: 1}


def test_slots_stop_at_a_layers_host_experts_and_fit_bigger_experts_last():
    assert cache_slots(10_000, {0: 100, 1: 300}, {0: 2, 1: 3}) == {0: 2, 1: 3}
    assert cache_slots(350, {0: 100, 1: 300}, {0: 2, 1: 3}) == {0: 2}     # 300 never fits after the first 100


def test_empty_slots_take_the_best_routed_experts_first():
    scores = np.array([0.0, 5.0, 1.0, 9.0])
    assert choose_swaps(scores, np.array([-1, -1, -1])) == [(0, 3), (1, 1), (2, 2)]   # never-routed 0 stays out


def test_a_resident_leaves_only_for_a_newcomer_ahead_beyond_the_counts_noise():
    scores = np.array([30.0, 4.0, 12.0, 20.0])
    resident = np.array([0, 1])                        # expert 1 is the worst resident (4.0)
    assert choose_swaps(scores, resident) == [(1, 3)]   # 20 - 4 > 2·√24; 12 - 4 is not > 2·√16
    assert choose_swaps(np.array([30.0, 4.0, 12.0]), resident) == []


def test_a_lead_counts_relative_to_the_scores_size():
    assert clearly_ahead(np.array([3.0, 130.0]), np.array([0.5, 80.0])).tolist() == [False, True]


def test_experts_routed_alike_do_not_trade_places_refresh_after_refresh():
    """A layer's routing drawn from fixed shares, folded and swapped as the cache does: the cache
    settles on the most routed experts and then copies almost nothing more."""
    rng = np.random.default_rng(1)
    n_host, n_slots, pairs_per_step = 96, 30, 4                      # half of top-8 goes to host experts
    shares = 1.0 / np.arange(1, n_host + 1) ** 0.6
    shares /= shares.sum()
    scores, resident = np.zeros(n_host), np.full(n_slots, -1)
    copies = []
    for _ in range(300):
        counts = rng.multinomial(REFRESH_STEPS * pairs_per_step, shares)
        scores = DECAY * scores + counts
        swaps = choose_swaps(scores, resident)
        for slot, newcomer in swaps:
            resident[slot] = newcomer
        copies.append(len(swaps))
    settled = sum(copies[100:]) / 200
    assert settled < 0.5                                             # copies a refresh, once settled
    best = np.argsort(-shares)[:n_slots]
    assert shares[resident].sum() > 0.9 * shares[best].sum()          # hit share near the best possible


@pytest.mark.parametrize("marks, runs", [("", []), ("0000", []), ("1111", [(0, 4)]), ("0110", [(1, 3)]),
                                          ("1001101", [(0, 1), (3, 5), (6, 7)])])
def test_a_streamed_layer_is_copied_in_runs_of_the_experts_not_cached(marks, runs):
    assert marked_runs(np.array([m == "1" for m in marks], bool)) == runs


def test_a_full_cache_of_the_best_experts_stays():
    assert choose_swaps(np.array([3.0, 2.0, 1.0]), np.array([0, 1])) == []


@pytest.mark.parametrize("copy_s, token_s, want", [(4e-3, 1e-4, 40), (1e-6, 1e-3, 2), (4e-3, 3e-4, 14)])
def test_auto_threshold_is_where_the_daemons_time_reaches_the_copys(copy_s, token_s, want):
    assert auto_threshold(copy_s, token_s) == want


@pytest.mark.parametrize("value, tokens", [("auto", AUTO), ("off", None), ("32", 32)])
def test_stream_threshold_values(value, tokens):
    assert RigConfig(stream_threshold=value).stream_tokens == tokens


@pytest.mark.parametrize("value", ["0", "-3", "sometimes", "1.5"])
def test_a_bad_stream_threshold_names_the_flag(value):
    with pytest.raises(ConfigError, match="--stream-threshold"):
        RigConfig(stream_threshold=value)


def test_a_negative_expert_cache_names_the_flag():
    with pytest.raises(ConfigError, match="--expert-cache"):
        RigConfig(expert_cache_bytes=-1)


def sizes(layers: int = 4, experts: int = 8, expert_bytes: int = 64 << 20) -> ModelSizes:
    return ModelSizes(n_layers=layers, n_experts=experts, n_experts_used=2, moe_layers=(True,) * layers,
                      expert_bytes=(expert_bytes,) * layers, non_expert_bytes=GiB,
                      kv_values_per_token=(256, 256))


def request(parent_gib: float, **reserve) -> PlanRequest:
    return PlanRequest(sizes=sizes(), parent=DeviceBudget("parent cuda:0", int(parent_gib * GiB), True),
                       daemons=(DeviceBudget("cpu", 64 * GiB),), context=1024, **reserve)


def test_the_streaming_buffers_are_not_reserved_when_every_expert_fits_without_them():
    result = plan(request(4.0, streams=True))                            # 2 GiB of experts fit beside 1 GiB
    assert all(np.all(homes == PARENT) for homes in result.placement.homes.values())
    assert result.devices[0].reserved_bytes == plan(request(4.0)).devices[0].reserved_bytes


def test_the_streaming_buffers_its_placement_needs_are_reserved():
    without, streaming = plan(request(3.5)), plan(request(3.5, streams=True))
    reserved = streaming.devices[0].reserved_bytes - without.devices[0].reserved_bytes
    needed = streaming_buffer_bytes(sizes(), streaming.placement)
    assert 0 < needed <= reserved                 # twice its largest layer's experts off the parent, at least
    assert streaming.devices[0].n_experts < without.devices[0].n_experts


def test_buffers_that_do_not_fit_say_how_to_turn_streaming_off():
    with pytest.raises(PlanError, match="--stream-threshold off"):
        plan(request(2.4, streams=True))


def test_the_expert_cache_is_reserved_on_the_parent_and_named_when_it_does_not_fit():
    cached = plan(request(3.0, expert_cache_bytes=GiB // 2))
    assert cached.devices[0].n_experts == plan(request(3.0)).devices[0].n_experts - 8
    with pytest.raises(PlanError, match=r"expert cache \(2.00 GiB\)"):
        plan(request(3.0, expert_cache_bytes=2 * GiB))


@pytest.mark.parametrize("share, want", [(0.4, [3, 5]), (0.0, []), (1.0, [3, 4, 5, 6, 7]), (0.6, [3, 4, 6])])
def test_reads_in_place_spread_over_a_layers_host_experts(share, want):
    assert spread(np.array([3, 4, 5, 6, 7]), share).tolist() == want


@pytest.mark.parametrize("value, share", [("off", None), ("0.25", 0.25), ("1", 1.0), ("0", 0.0)])
def test_gpu_reads_values(value, share):
    assert RigConfig(gpu_reads=value).read_share == share


@pytest.mark.parametrize("value", ["1.5", "-0.1", "half", "auto"])
def test_a_bad_gpu_reads_names_the_flag(value):
    with pytest.raises(ConfigError, match="--gpu-reads"):
        RigConfig(gpu_reads=value)


def test_swaps_on_random_caches_keep_their_rules():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, c = int(rng.integers(1, 20)), int(rng.integers(1, 8))
        scores = np.where(rng.random(n) < 0.3, 0.0, rng.random(n) * 10)
        resident = np.full(c, -1)
        held = rng.permutation(n)[:int(rng.integers(0, min(c, n) + 1))]
        resident[rng.permutation(c)[:len(held)]] = held
        swaps = choose_swaps(scores, resident)
        slots, newcomers = [s for s, _ in swaps], [e for _, e in swaps]
        assert len(set(slots)) == len(slots) and len(set(newcomers)) == len(newcomers)
        assert all(scores[e] > 0 and e not in resident for e in newcomers)
        empty = int((resident < 0).sum())
        assert all(resident[s] < 0 for s in slots[:empty])                          # empty slots first
        assert all(resident[s] < 0 or clearly_ahead(scores[e], scores[resident[s]]) for s, e in swaps)
        assert newcomers == sorted(newcomers, key=lambda e: -scores[e])              # best newcomers first
