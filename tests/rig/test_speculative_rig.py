"""Speculative decoding through a rig: a verify step's tokens go to the expert daemons as one
request per daemon per layer, and the output is plain decoding's, a daemon killed mid-run too."""
from __future__ import annotations

import os
import signal

import pytest

from moerun.engine.runtime import RunStats, Runtime
from moerun.engine.speculative import SpecParams
from moerun.rig.settings import RigConfig
from tests.support.daemon_fixtures import GREEDY, N_TOKENS, PROMPT, fault_free_tokens, tiny_daemon_model
from tests.support.shm_segments import shm_segments

FORCED = SpecParams("ngram", draft_max=4, gated=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_daemon_model(tmp_path_factory.mktemp("spec-rig"))


@pytest.mark.parametrize("kill", [False, True], ids=["daemons-up", "daemon-killed"])
def test_speculation_with_cpu_daemons_gives_the_local_tokens(model, kill):
    local = fault_free_tokens(model)
    prompt = [*PROMPT, *local[:6], *PROMPT]                  # repeats, so the n-gram drafter drafts
    with Runtime(model) as alone:
        plain = list(alone.generate(prompt, N_TOKENS, GREEDY))
    stats = RunStats()
    with Runtime(model, rig=RigConfig(daemons=("cpu", "cpu"), hot=1, daemon_timeout_s=20)) as runtime:
        link = runtime.rig.links[0]
        tokens = []
        for token in runtime.generate(prompt, N_TOKENS, GREEDY, stats=stats, speculation=FORCED):
            tokens.append(token)
            if kill and len(tokens) == 3:
                os.kill(link.local.process.pid, signal.SIGKILL)
        calls, times_down = link.client.counters.calls, link.times_down
    assert tokens == plain
    assert stats.speculation.verify_steps > 0
    assert calls > 0 and times_down == int(kill)
    assert not shm_segments()


def test_speculation_through_a_layer_shard_gives_the_local_tokens(model):
    """The shard's KV cache goes back with the parent's (the next step starts before its end)."""
    local = fault_free_tokens(model)
    prompt = [*PROMPT, *local[:6], *PROMPT]
    with Runtime(model) as alone:
        plain = list(alone.generate(prompt, N_TOKENS, GREEDY))
    stats = RunStats()
    with Runtime(model, rig=RigConfig(splits=(("cpu", 2),), daemon_timeout_s=20)) as split:
        tokens = list(split.generate(prompt, N_TOKENS, GREEDY, stats=stats, speculation=FORCED))
        again = list(split.generate(prompt, N_TOKENS, GREEDY))
    assert tokens == plain == again
    spec = stats.speculation
    assert spec.verify_steps > 0 and spec.accepted_tokens < spec.drafted_tokens, "drafts dropped by the shard too"
