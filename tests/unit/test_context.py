"""The context a parent holds (moe/context.py): the model's where its cache fits beside the
weights, else the most that fits; --ctx checked where the cache is allocated whole; the one line
that says so; and the runtime choosing it from what its backend reports."""
from __future__ import annotations

import logging

import pytest

from moerun.backends.numpy_backend import NumpyBackend
from moerun.engine.runtime import Runtime
from moerun.moe.context import CONTEXT_STEP, HEADROOM_BYTES, ContextRoom, choose_context
from moerun.moe.planner import PlanError
from moerun.writers.synthetic import SyntheticConfig, write_synthetic_model

MiB = 1 << 20


def room(free_mib: float, kv: int = 96 * 1024, work: int = 0, grows: bool = False) -> ContextRoom:
    return ContextRoom(HEADROOM_BYTES + int(free_mib * MiB), kv, work, "f16", grows)


def test_the_models_context_where_it_fits():
    assert choose_context(40960, None, None, room(40960 * 96 / 1024 + 1)) == (40960, None)   # nothing to say


def test_the_most_that_fits_in_whole_steps_where_the_models_does_not():
    space = room(1000, kv=96 * 1024, work=32 * 1024)          # 1000 MiB for 128 KiB a position: 8000
    ctx, line = choose_context(262144, None, None, space)
    assert space.largest == 8000 and ctx == 8000 // CONTEXT_STEP * CONTEXT_STEP == 7936
    assert "context: 7936 of the model's 262144 tokens, the most whose cache fits" in line


def test_a_pool_is_what_must_fit():
    ctx, _ = choose_context(262144, None, 4096, room(4096 * 96 / 1024))
    assert ctx == 262144                                       # a pool of 4096 fits: the model's context


def test_a_ctx_that_does_not_fit_is_an_error_naming_the_most_that_does():
    with pytest.raises(PlanError, match=r"--ctx 100000: 100000 tokens: 9.16 GiB of KV cache at f16 .* the most "
                                        r"that fits is 10922 tokens"):
        choose_context(262144, 100000, None, room(1024))
    with pytest.raises(PlanError, match="--kv-pool 50000: 50000 tokens"):
        choose_context(262144, 100000, 50000, room(1024))
    assert choose_context(262144, 8192, None, room(1024)) == (8192, None)      # fits: nothing to say


def test_a_growing_cache_is_only_warned_about():
    ctx, line = choose_context(262144, 100000, None, room(1024, grows=True))
    assert ctx == 100000 and "would pass the" in line and "which the cache grows into" in line


def test_no_room_at_all_is_an_error():
    with pytest.raises(PlanError, match="no room for a KV cache"):
        choose_context(4096, None, None, ContextRoom(HEADROOM_BYTES // 2, 1024, 0, "f16", False))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = SyntheticConfig(name="context-test", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=32,
                             n_experts=4, n_experts_used=2, expert_ff=32, vocab_size=300, context=32768)
    path = tmp_path_factory.mktemp("context") / "m.gguf"
    return write_synthetic_model(path, config, "a b c d " * 20, bigram_head=False)


def test_the_runtime_takes_the_models_context_or_what_its_backend_has_room_for(model, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="moerun")
    with Runtime(model) as runtime:
        assert runtime.ctx == runtime.spec.context_train == 32768
    assert "context:" not in caplog.text
    position = 2 * 2 * (32 + 32) * 4                        # layers · kv heads · (K + V dims) · f32
    monkeypatch.setattr(NumpyBackend, "context_memory", lambda self, ubatch: (HEADROOM_BYTES + 3000 * position, 0))
    with Runtime(model) as runtime:
        assert runtime.ctx == 3000 // CONTEXT_STEP * CONTEXT_STEP
    assert "context: 2816 of the model's 32768 tokens, the most whose cache fits: 2.8 MiB of KV cache" in caplog.text
    with Runtime(model, ctx=64) as runtime:
        assert runtime.ctx == 64
