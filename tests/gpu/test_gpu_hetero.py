"""A parent on cuda:0 with an expert daemon on cuda:1 (a real child process seeing only its
own GPU), for every transport and prefill mode, against all-local on cuda:0: the logits of
a prefill within the f16 bound, the same greedy tokens through decode steps captured as
graph segments, and a daemon killed mid-generation changing nothing.
With one GPU the daemon shares cuda:0 (the same buffers, events and graphs, one device)."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.rig.settings import RigConfig
from moerun.writers.bench_model import MIXES, PRESETS, write_bench_model
from tests.support.gpu import gpu_count, gpu_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_device() != "cuda:0", reason="needs a CUDA GPU")]
DAEMON_GPU = "cuda:1" if gpu_count() >= 2 else "cuda:0"

GREEDY = SamplingParams(temperature=0.0)
PREFILL_BOUND = {"f32": 1e-3, "f16": 3e-3, "bf16": 2e-2}   # f16 prefill products; payload rounding on top
PROMPT = np.random.default_rng(4).integers(0, 1000, 40).tolist()
HOT = 4                                                     # of the tiny model's 8 experts per layer


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_bench_model(tmp_path_factory.mktemp("hetero") / "tiny.gguf", PRESETS["tiny"], MIXES["q4_k_m"], seed=7)


@pytest.fixture(scope="module")
def all_local(model):
    with Runtime(model, ubatch=512, rig=RigConfig(device="cuda:0")) as local:
        return local.logits(PROMPT), list(local.generate(PROMPT[:8], 32, GREEDY))


def hetero(transport: str, mode: str = "batched", payload_dtype: str = "f32") -> RigConfig:
    return RigConfig(device="cuda:0", daemons=(DAEMON_GPU,), hot=HOT, transport=transport, mode=mode,
                     payload_dtype=payload_dtype, daemon_timeout_s=60, require_daemons=True)


@pytest.mark.parametrize("mode", ["batched", "stream"])
@pytest.mark.parametrize("transport", ["device", "shared", "stream"])
def test_two_gpus_match_all_local(model, all_local, transport, mode):
    want_logits, want_tokens = all_local
    with Runtime(model, ubatch=512, rig=hetero(transport, mode)) as runtime:
        got = runtime.logits(PROMPT)
        tokens = list(runtime.generate(PROMPT[:8], 32, GREEDY))
        stats = runtime.moe_stats()
        link = runtime.rig.links[0]
        calls = link.client.counters.calls
        daemon_captured = link.client.stats()["captured_steps"]
        layers = runtime.model.weights.experts.layers
        parent_experts = {layer: experts.down.experts for layer, experts in layers.items()}
    assert link.transport == transport
    assert relative_error(got, want_logits) <= PREFILL_BOUND["f32"]
    assert tokens == want_tokens
    assert stats.remote_pairs > 0 and stats.fallback_pairs == 0
    assert parent_experts == {0: HOT, 1: HOT}                 # the parent holds its hot experts only
    prefill_calls = 2 * (40 // 4 if mode == "stream" else 1)    # per logits() pass: layers x calls per layer
    assert calls >= prefill_calls + 2 * 32
    # a slotted daemon replays each layer's one-token work as a graph (per slot it came through)
    assert daemon_captured >= 2 if transport in ("device", "shared") else daemon_captured == 0


@pytest.mark.parametrize("payload_dtype", ["f16", "bf16"])
def test_payload_dtypes_over_the_device_transport(model, all_local, payload_dtype):
    want_logits, _ = all_local
    with Runtime(model, ubatch=512, rig=hetero("device", payload_dtype=payload_dtype)) as runtime:
        got = runtime.logits(PROMPT)
    assert relative_error(got, want_logits) <= PREFILL_BOUND[payload_dtype]


def test_auto_picks_device_direct_between_cuda_gpus(model):
    with Runtime(model, ubatch=512, rig=hetero("auto")) as runtime:
        assert runtime.rig.links[0].transport == "device"


def test_few_token_chunks_match_all_local(model):
    """Prefill in chunks of 8 (the GEMV path on both sides) and decode, device-direct."""
    with Runtime(model, ubatch=8, rig=RigConfig(device="cuda:0")) as local:
        want = local.logits(PROMPT)
    with Runtime(model, ubatch=8, rig=hetero("device")) as runtime:
        got = runtime.logits(PROMPT)
    assert relative_error(got, want) <= 1e-5


@pytest.mark.parametrize("transport", ["device", "shared"])
def test_a_daemon_killed_mid_decode_changes_no_token(model, all_local, transport):
    """Killed while graph segments replay: that step runs again eagerly with the daemon's
    experts computed on the parent's CPU; the daemon restarts, rejoins, and the steps are
    captured again for its new session."""
    _, want_tokens = all_local
    rig = RigConfig(device="cuda:0", daemons=(DAEMON_GPU,), hot=HOT, transport=transport, daemon_timeout_s=30)
    with Runtime(model, ubatch=512, rig=rig) as runtime:
        link = runtime.rig.links[0]
        tokens = []
        for token in runtime.generate(PROMPT[:8], 32, GREEDY):
            tokens.append(token)
            if len(tokens) == 6:
                link.local.process.kill()
        stats = runtime.moe_stats()
        times_down = link.times_down
    assert tokens == want_tokens
    assert times_down == 1 and stats.fallback_pairs > 0
