"""A GPU expert daemon (a real child process computing on the GPU with the parent's
kernels) against the parent computing every expert itself on the CPU."""
from __future__ import annotations

import signal

import numpy as np
import pytest

from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig
from moerun.writers.bench_model import MIXES, PRESETS, write_bench_model
from tests.support.gpu import INT_GEMV_BOUND, gpu_device

pytestmark = pytest.mark.gpu
# every host pair to the CPU daemon (streaming and the GPU's reads in place: test_gpu_host_experts.py)
DAEMON_PATH_ONLY = {"stream_threshold": "off"}


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_bench_model(tmp_path_factory.mktemp("daemon") / "tiny.gguf", PRESETS["tiny"], MIXES["q4_k_m"], seed=7)


@pytest.mark.parametrize("ubatch, bound", [(8, INT_GEMV_BOUND), (512, 1e-3)], ids=["gemv", "tiles"])
def test_gpu_daemon_matches_cpu(model, ubatch, bound):
    ids = np.random.default_rng(3).integers(0, 800, 40).tolist()
    with Runtime(model, ubatch=ubatch) as local:
        want = local.logits(ids)
    rig = RigConfig(daemons=(gpu_device(),), hot=2, daemon_timeout_s=60, require_daemons=True)
    with Runtime(model, ubatch=ubatch, rig=rig) as remote:
        got = remote.logits(ids)
        stats = remote.moe_stats()
    assert stats.remote_pairs > 0 and stats.fallback_pairs == 0
    assert relative_error(got, want) <= bound


@pytest.mark.parametrize("ubatch, bound", [(8, INT_GEMV_BOUND), (512, 1e-3)], ids=["gemv", "tiles"])
def test_gpu_parent_with_a_cpu_daemon_matches_all_local_gpu(model, ubatch, bound):
    """Layers whose experts are all on the parent run on the device alone (decided there);
    the others send the daemon its share."""
    from moerun.engine.sampler import SamplingParams
    ids = np.random.default_rng(4).integers(0, 800, 40).tolist()
    greedy = SamplingParams(temperature=0.0)
    with Runtime(model, ubatch=ubatch, rig=RigConfig(device=gpu_device())) as local:
        want = local.logits(ids)
        want_tokens = list(local.generate(ids[:8], 24, greedy))
    rig = RigConfig(device=gpu_device(), daemons=("cpu",), hot=4, daemon_timeout_s=60, require_daemons=True,
                    **DAEMON_PATH_ONLY)
    with Runtime(model, ubatch=ubatch, rig=rig) as remote:
        got = remote.logits(ids)
        got_tokens = list(remote.generate(ids[:8], 24, greedy))
        stats = remote.moe_stats()
    assert stats.remote_pairs > 0 and stats.hot_only_layer_calls > 0 and stats.fallback_pairs == 0
    assert relative_error(got, want) <= bound
    assert got_tokens == want_tokens


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_cpu_daemon_failing_inside_a_captured_step_changes_no_token(model, fault):
    """Captured decode steps ring the CPU daemon from the GPU and await its replies there. A
    daemon killed (the host sees the process gone and aborts the device's waits) or stopped (no
    reply: the wait kernel gives up after the daemon timeout) while such steps run: that step
    runs again eagerly with the daemon's experts on the parent's CPU, and the daemon comes back."""
    from moerun.engine.sampler import SamplingParams
    prompt = np.random.default_rng(5).integers(0, 800, 8).tolist()
    greedy = SamplingParams(temperature=0.0)
    with Runtime(model, ubatch=8, rig=RigConfig(device=gpu_device())) as local:
        want = list(local.generate(prompt, 24, greedy))
    rig = RigConfig(device=gpu_device(), daemons=("cpu",), hot=4, daemon_timeout_s=2, **DAEMON_PATH_ONLY)
    with Runtime(model, ubatch=8, rig=rig) as remote:
        link = remote.rig.links[0]
        tokens, calls, reasons = [], [], set()
        for token in remote.generate(prompt, 24, greedy):
            tokens.append(token)
            calls.append(link.client.counters.calls)
            reasons.add(link.down_reason)
            if len(tokens) == 6:
                link.local.process.send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        times_down = link.times_down
        stats = remote.moe_stats()
    assert tokens == want
    assert calls[4] > calls[3] > calls[2]           # replayed steps' requests, rung from the device, are counted
    assert times_down == 1 and stats.fallback_pairs > 0
    assert reasons - {None} == {"died" if fault == "killed" else "did not answer within 2 s"}
