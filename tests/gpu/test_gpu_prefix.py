"""Prefix snapshots on a GPU parent: a request resumed from a snapshot (in RAM, and from disk
after a restart) gives the greedy tokens of a full prefill, through captured decode graphs, in
either KV element type; and a hybrid model's DeltaNet states resume from a snapshot."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.engine.prefix_cache import PrefixCache
from moerun.engine.runtime import RunStats, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.rig.settings import RigConfig
from tests.support.gpu import gpu_device
from tests.support.hf_models import tiny_model
from tests.support.to_gguf import write_gguf

pytestmark = pytest.mark.gpu
RNG = np.random.default_rng(5)
SYSTEM, QUESTION, FOLLOW_UP = (RNG.integers(0, 300, n).tolist() for n in (40, 7, 5))
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_gguf(tiny_model("qwen3moe", seed=3), tmp_path_factory.mktemp("prefix") / "m.gguf", "Q8_0")


def answer(runtime: Runtime, prompt: list[int]) -> tuple[list[int], RunStats]:
    stats = RunStats()
    return list(runtime.generate(prompt, 12, GREEDY, stats=stats)), stats


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_resumed_requests_decode_as_full_ones(model_path, tmp_path, kv_dtype):
    rig = RigConfig(device=gpu_device(), kv_dtype=kv_dtype)

    def cache() -> PrefixCache:
        return PrefixCache(slots=4, interval=16, folder=tmp_path, disk_budget=1 << 30)

    with Runtime(model_path, rig=rig, ubatch=8, prefix_cache=cache()) as gpu:
        reply, _ = answer(gpu, SYSTEM + QUESTION)
        turn = SYSTEM + QUESTION + reply + FOLLOW_UP
        resumed, stats = answer(gpu, turn)
        other, other_stats = answer(gpu, SYSTEM + FOLLOW_UP)
    assert stats.restored_tokens == len(SYSTEM + QUESTION + reply) - 1 and other_stats.restored_tokens == 32
    with Runtime(model_path, rig=rig, ubatch=8, prefix_cache=cache()) as restarted:
        after_restart, restart_stats = answer(restarted, turn)
    assert restart_stats.restored_tokens == len(turn)         # its own prompt's snapshot, from disk
    with Runtime(model_path, rig=rig, ubatch=8) as fresh:
        assert resumed == after_restart == answer(fresh, turn)[0]
        assert other == answer(fresh, SYSTEM + FOLLOW_UP)[0]


def test_a_hybrid_models_states_resume_from_a_snapshot(tmp_path):
    """qwen35moe on the GPU: a snapshot after 16 tokens (its DeltaNet layers' conv and recurrent
    states with the attention layers' KV), restored into a fresh cache, gives the next 8 tokens'
    logits of the sequence run straight on; a new sequence starts again from zero states."""
    path = write_gguf(tiny_model("qwen35moe", seed=1), tmp_path / "hybrid.gguf", "F32")
    ids = np.random.default_rng(6).integers(0, 300, 24)
    with Runtime(path, rig=RigConfig(device=gpu_device(), kv_dtype="f32"), ubatch=8) as gpu:
        model, backend = gpu.model, gpu.backend

        def run_on(cache):
            model.forward(ids[:16], cache, all_logits=True)
            return model.forward(ids[16:], cache, all_logits=True)

        straight = run_on(backend.new_cache(gpu.ctx))
        cache = backend.new_cache(gpu.ctx)
        model.forward(ids[:16], cache, all_logits=True)
        state = cache.snapshot()
        assert state.length == 16 and set(state.conv) == set(state.ssm) and state.conv and state.keys
        resumed = model.forward(ids[16:], backend.restore_cache(state, gpu.ctx), all_logits=True)
        again = run_on(backend.new_cache(gpu.ctx))
    assert np.array_equal(resumed, straight) and np.array_equal(again, straight)
