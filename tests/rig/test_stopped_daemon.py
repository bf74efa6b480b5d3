"""A daemon stopped (SIGSTOP) mid-generation costs one --daemon-timeout, once: the first request
it misses marks it down and its experts run on the parent from then on, whether the parent
spawned it or connects to it, over either transport; the answer never changes. Real daemon
processes: one spawned, one started by hand."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig
from tests.support.daemon_fixtures import GREEDY, PROMPT, tiny_daemon_model, wait_for_socket

STEPS = 32                    # tokens generated
STOP_AFTER = 4                # tokens before the daemon is stopped
TIMEOUT_S = 2.0               # --daemon-timeout


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_daemon_model(tmp_path_factory.mktemp("stopped"))


@pytest.fixture(scope="module")
def local_tokens(model):
    with Runtime(model) as runtime:
        return list(runtime.generate(PROMPT, STEPS, GREEDY))


@pytest.fixture
def connected_daemon(model, tmp_path):
    """A `moerun daemon` started by hand; continued and killed at the end."""
    endpoint = f"ipc://{tmp_path}/d1.sock"
    with (tmp_path / "d1.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "moerun", "daemon", "-m", str(model), "--listen", endpoint],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        wait_for_socket(Path(endpoint.removeprefix("ipc://")), process)
        yield endpoint, process
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()


@pytest.mark.parametrize("transport", ["shared", "stream"])
@pytest.mark.parametrize("stopped", ["spawned", "connected"])
def test_a_stopped_daemon_costs_one_timeout_not_one_per_step(model, local_tokens, connected_daemon, stopped,
                                                             transport):
    endpoint, connected = connected_daemon
    rig = RigConfig(daemons=("cpu", endpoint), hot=1, transport=transport, daemon_timeout_s=TIMEOUT_S)
    with Runtime(model, rig=rig) as runtime:
        link = runtime.rig.links[0 if stopped == "spawned" else 1]
        tokens, step_seconds = [], []
        last = time.monotonic()
        for token in runtime.generate(PROMPT, STEPS, GREEDY):
            tokens.append(token)
            now = time.monotonic()
            step_seconds.append(now - last)
            last = now
            if len(tokens) == STOP_AFTER:
                os.kill(link.local.process.pid if link.local else connected.pid, signal.SIGSTOP)
        times_down, reason = link.times_down, link.down_reason
    assert tokens == local_tokens
    assert times_down == 1 and (reason is None or reason == f"did not answer within {TIMEOUT_S:g} s")
    after_stop = sum(step_seconds[STOP_AFTER:])
    steps = STEPS - STOP_AFTER
    assert after_stop < steps * TIMEOUT_S / 4, (
        f"{after_stop:.1f} s for the {steps} steps after the stop (each missed request costs {TIMEOUT_S:g} s)")


def test_a_daemon_stopped_before_a_prefill_of_more_calls_than_slots_costs_one_timeout(model):
    """--mode stream cuts a 64-token prefill into 16 calls per layer, more than the arena's 4
    slots: the fifth waits for a free slot, as long as any request may wait, not longer."""
    rig = RigConfig(daemons=("cpu",), hot=1, mode="stream", transport="shared", daemon_timeout_s=TIMEOUT_S)
    with Runtime(model, rig=rig) as runtime:
        link = runtime.rig.links[0]
        os.kill(link.local.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        list(runtime.generate(list(range(5, 69)), 2, GREEDY))
        seconds = time.monotonic() - started
        assert link.times_down == 1
    assert seconds < 3 * TIMEOUT_S, f"{seconds:.1f} s for a prefill whose daemon stopped (one timeout: {TIMEOUT_S:g} s)"
