"""A CPU daemon stopped (SIGSTOP) while a GPU parent replays captured decode steps costs one
--daemon-timeout, not one per layer: the first wait kernel that gives up aborts the step's
later waits, the daemon is marked down and the step runs again eagerly without it."""
from __future__ import annotations

import dataclasses
import signal
import time

import numpy as np
import pytest

from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig
from moerun.writers.bench_model import MIXES, PRESETS, write_bench_model
from tests.support.gpu import gpu_device

pytestmark = pytest.mark.gpu
LAYERS = 12                   # each with experts on the daemon: one wait per layer per step
TIMEOUT_S = 2.0
STEPS, STOP_AFTER = 24, 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    shape = dataclasses.replace(PRESETS["tiny"], name="tiny-12-layers", n_layers=LAYERS)
    return write_bench_model(tmp_path_factory.mktemp("stopped") / "tiny12.gguf", shape, MIXES["q4_k_m"], seed=7)


def test_a_cpu_daemon_stopped_inside_captured_steps_costs_one_timeout(model):
    from moerun.engine.sampler import SamplingParams
    prompt = np.random.default_rng(5).integers(0, 800, 8).tolist()
    greedy = SamplingParams(temperature=0.0)
    with Runtime(model, ubatch=8, rig=RigConfig(device=gpu_device())) as local:
        want = list(local.generate(prompt, STEPS, greedy))
    rig = RigConfig(device=gpu_device(), daemons=("cpu",), hot=4, daemon_timeout_s=TIMEOUT_S,
                    stream_threshold="off")
    with Runtime(model, ubatch=8, rig=rig) as remote:
        link = remote.rig.links[0]
        tokens, stopped_at = [], None
        for token in remote.generate(prompt, STEPS, greedy):
            tokens.append(token)
            if len(tokens) == STOP_AFTER:
                link.local.process.send_signal(signal.SIGSTOP)
                stopped_at = time.monotonic()
        after_stop = time.monotonic() - stopped_at
        times_down = link.times_down
    assert tokens == want
    assert times_down == 1
    assert after_stop < 3 * TIMEOUT_S, (f"{after_stop:.1f} s after the stop: one timeout is {TIMEOUT_S:g} s, one per "
                                        f"layer would be {LAYERS * TIMEOUT_S:g} s")
