"""Layer shards on a GPU: the parent on the GPU with one and two layer shards on the same GPU
(real shard processes, the hidden state going device to device through their exported buffers,
or through a shared arena), against all-local on that GPU: the prefill logits and 64 greedy
tokens, a shard killed mid-request failing that request clearly and the next one right."""
from __future__ import annotations

import dataclasses
import signal

import numpy as np
import pytest

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.rig.settings import RigConfig
from moerun.rig.shards import ShardFailed
from moerun.writers.bench_model import MIXES, PRESETS, write_bench_model
from tests.support.gpu import gpu_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_device() is None, reason="needs a GPU")]

GREEDY = SamplingParams(temperature=0.0)
PROMPT = np.random.default_rng(6).integers(0, 1000, 40).tolist()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    shape = dataclasses.replace(PRESETS["tiny"], n_layers=3)
    return write_bench_model(tmp_path_factory.mktemp("split") / "tiny.gguf", shape, MIXES["q4_k_m"], seed=7)


@pytest.fixture(scope="module")
def all_local(model):
    with Runtime(model, ubatch=512, rig=RigConfig(device=gpu_device())) as local:
        return local.logits(PROMPT), list(local.generate(PROMPT[:8], 64, GREEDY))


@pytest.mark.parametrize("boundaries, transport", [((1,), "auto"), ((1, 2), "auto"), ((1,), "shared")],
                         ids=["1 shard", "2 shards", "1 shard through the arena"])
def test_shards_on_the_same_gpu_give_the_all_local_logits_and_tokens(model, all_local, boundaries, transport):
    want_logits, want_tokens = all_local
    device = gpu_device()
    rig = RigConfig(device=device, splits=tuple((device, layer) for layer in boundaries), payload_dtype="f32",
                    transport=transport)
    with Runtime(model, ubatch=512, rig=rig) as split:
        logits = split.logits(PROMPT)
        tokens = list(split.generate(PROMPT[:8], 64, GREEDY))
        captured = split.backend.captured_steps
        shards_captured = [link.client.stats()["captured_steps"] for link in split.shards.links]
        shard_calls = split.shards.links[-1].counters.calls
        device_direct = [link.device is not None for link in split.shards.links]
    assert device_direct == [transport == "auto"] * len(boundaries)     # auto: GPUs of one vendor, device to device
    assert relative_error(logits, want_logits) <= 1e-5
    assert tokens == want_tokens
    assert captured == 1                   # the decode steps replay one captured chain, hops and all
    assert shards_captured == [1] * len(boundaries)        # and so do each shard's steps
    assert shard_calls >= 64


def test_through_the_arena_between_gpus_the_hidden_state_goes_as_bf16_unless_asked(model, all_local):
    want_logits, _ = all_local
    device = gpu_device()
    with Runtime(model, ubatch=512, rig=RigConfig(device=device, splits=((device, 1),), transport="shared")) as split:
        assert split.shards.links[0].dtype == "bf16"
        assert 1e-5 < relative_error(split.logits(PROMPT), want_logits) <= 2e-2


def test_a_gpu_shard_killed_mid_request(model, all_local):
    want_logits, want_tokens = all_local
    device = gpu_device()
    rig = RigConfig(device=device, splits=((device, 1),), payload_dtype="f32")
    with Runtime(model, ubatch=512, rig=rig) as split:
        link = split.shards.links[0]
        with pytest.raises(ShardFailed, match="died: the request fails"):
            for n, _ in enumerate(split.generate(PROMPT[:8], 64, GREEDY)):
                if n == 6:                 # replayed steps by now
                    link.local.process.send_signal(signal.SIGKILL)
        assert relative_error(split.logits(PROMPT), want_logits) <= 1e-5
        assert link.restarts == 1


def test_split_auto_keeps_a_model_that_fits_on_the_parent(model, all_local):
    """One GPU with room for the tiny model: --split auto plans no shard."""
    want_logits, _ = all_local
    with Runtime(model, ubatch=512, rig=RigConfig(device=gpu_device(), split_auto=True)) as runtime:
        assert runtime.shards is None
        assert relative_error(runtime.logits(PROMPT), want_logits) <= 1e-5
