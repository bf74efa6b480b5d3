"""Daemons that die, stall or are refused: the answer never changes, nothing hangs,
nothing is left behind."""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from moerun.engine.runtime import Runtime
from moerun.rig.links import RigError
from moerun.rig.settings import RigConfig
from tests.support.daemon_fixtures import (
    GREEDY,
    N_TOKENS,
    PROMPT,
    fault_free_tokens,
    running_daemons,
    tiny_daemon_model,
)
from tests.support.hf_models import tiny_model
from tests.support.live_processes import (
    REJOIN_TIMEOUT_S,
    child_pids,
    exited,
    tcp_endpoint,
    wait_until,
)
from tests.support.shm_segments import shm_segments
from tests.support.to_gguf import write_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_daemon_model(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def local_tokens(model):
    return fault_free_tokens(model)


def timed(fault):
    """`fault`, noting when it struck in .struck_at: the time after it excludes the daemons' start,
    which a loaded machine can stretch to many seconds."""
    def strike(link):
        strike.struck_at = time.monotonic()
        fault(link)
    return strike


def generate_with_fault(model, fault, rig: RigConfig, after: int = 4):
    """Greedy tokens with `fault(link)` applied to daemon d0 after `after` tokens."""
    with Runtime(model, rig=rig) as runtime:
        link = runtime.rig.links[0]
        tokens = []
        for token in runtime.generate(PROMPT, N_TOKENS, GREEDY):
            tokens.append(token)
            if len(tokens) == after:
                fault(link)
        return tokens, link, runtime.moe_stats()


@pytest.mark.parametrize("transport", ["shared", "stream"])
def test_kill_9_of_a_daemon_mid_generation(model, local_tokens, transport):
    rig = RigConfig(daemons=("cpu", "cpu"), hot=1, transport=transport, daemon_timeout_s=20)
    kill = timed(lambda link: os.kill(link.local.process.pid, signal.SIGKILL))
    tokens, link, stats = generate_with_fault(model, kill, rig)
    assert tokens == local_tokens
    assert link.times_down == 1 and link.fallback_calls > 0 and stats.fallback_pairs > 0
    assert link.down_since - kill.struck_at < 10, "a dead daemon must be noticed well before the deadline"
    assert not shm_segments()


def test_kill_9_of_a_daemon_mid_batch_costs_no_sequence_its_answer(model):
    """Three sequences decoded together (the scheduler's batched steps) while daemon d0 is
    killed after four steps: each gets the tokens it gets alone with every expert on the parent."""
    prompts = [PROMPT, PROMPT[:3], PROMPT[2:] + PROMPT[:2]]
    with Runtime(model) as local:
        alone = [list(local.generate(p, N_TOKENS, GREEDY)) for p in prompts]
    rig = RigConfig(daemons=("cpu", "cpu"), hot=1, transport="shared", daemon_timeout_s=20)
    with Runtime(model, rig=rig) as runtime:
        link = runtime.rig.links[0]
        scheduler = runtime.scheduler()
        ids = [scheduler.add(p, N_TOKENS, GREEDY) for p in prompts]
        tokens = {i: [] for i in ids}
        for step in itertools.count(1):
            if not scheduler.running:
                break
            for event in scheduler.step():
                if event.token is not None:
                    tokens[event.sequence].append(event.token)
            if step == 4:
                os.kill(link.local.process.pid, signal.SIGKILL)
        assert [tokens[i] for i in ids] == alone
        assert link.times_down == 1 and link.fallback_calls > 0
    assert not shm_segments()


@pytest.mark.parametrize("transport", ["shared", "stream"])
def test_sigstop_of_a_daemon_mid_generation(model, local_tokens, transport):
    timeout = 1.0
    rig = RigConfig(daemons=("cpu",), hot=1, transport=transport, daemon_timeout_s=timeout)
    stop = timed(lambda link: os.kill(link.local.process.pid, signal.SIGSTOP))
    tokens, link, stats = generate_with_fault(model, stop, rig)
    assert tokens == local_tokens
    assert link.times_down == 1 and stats.fallback_pairs > 0
    assert time.monotonic() - stop.struck_at < 10 * timeout
    assert not shm_segments()


def test_require_daemons_stops_with_a_clear_error(model):
    rig = RigConfig(daemons=("cpu",), hot=1, require_daemons=True)
    with pytest.raises(RigError, match="require-daemons"):
        generate_with_fault(model, lambda link: os.kill(link.local.process.pid, signal.SIGKILL), rig)
    assert not shm_segments()


def test_fingerprint_mismatch_is_refused(model, tmp_path):
    other = write_gguf(tiny_model("qwen3moe", seed=5), tmp_path / "other.gguf", "F32")
    with running_daemons(other, 1, tmp_path) as endpoints:
        with pytest.raises(RigError, match="fingerprint"):
            Runtime(model, rig=RigConfig(daemons=tuple(endpoints)))
    log = (tmp_path / "test-daemon-0.log").read_text()
    assert "fingerprint" in log


def test_second_parent_is_refused_while_the_first_is_connected(model, tmp_path):
    with running_daemons(model, 1, tmp_path) as endpoints:
        rig = RigConfig(daemons=tuple(endpoints))
        with Runtime(model, rig=rig):
            with pytest.raises(RigError, match="busy"):
                Runtime(model, rig=rig)
        with Runtime(model, rig=rig) as again:                  # released: a new parent gets in
            assert again.rig.links[0].up


def test_daemon_that_fails_to_start_shows_its_stderr(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(Exception) as caught:
        Runtime(broken, rig=RigConfig(daemons=("cpu",)))
    assert "broken.gguf" in str(caught.value)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_parent_signal_takes_its_daemons_along(model, signum):
    """kill -9, SIGTERM or Ctrl-C of the parent mid-generation: its spawned daemons exit,
    no shared memory is left, and its run directory is gone (after kill -9 the daemons remove it)."""
    parent = subprocess.Popen(
        [sys.executable, "-m", "moerun", "run", "-m", str(model), "--daemon", "cpu", "--daemon", "cpu", "--hot", "1",
         "-n", "100000", "--ctx", "512", "--temp", "0", "-p", "hello"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert parent.stdout.read(8), "the parent produced no text"
        daemons = child_pids(parent.pid)
        assert len(daemons) == 2
        parent.send_signal(signum)
        _, stderr = parent.communicate(timeout=20)
        assert b"Traceback" not in stderr, stderr.decode()
        deadline = time.monotonic() + 10
        while not all(exited(pid) for pid in daemons):
            assert time.monotonic() < deadline, "daemons outlived their parent"
            time.sleep(0.05)
        assert not [s for s in shm_segments() if s.startswith(f"moerun-{parent.pid}-")]
        assert not list(Path(tempfile.gettempdir()).glob(f"moerun-run-{parent.pid}-*"))
    finally:
        parent.kill()
        parent.wait()


def test_a_daemon_unreachable_at_start_costs_speed_never_the_answer(model, local_tokens, capfd):
    """Nothing listens at the daemon's address: the parent starts on its own experts at once, says
    so once, keeps calling, and takes the daemon in once one listens there."""
    endpoint = tcp_endpoint()
    started = time.monotonic()
    with Runtime(model, rig=RigConfig(daemons=(endpoint,), hot=1, daemon_timeout_s=2)) as runtime:
        assert time.monotonic() - started < 10
        link = runtime.rig.links[0]
        assert not link.up and "at start" in link.down_reason
        assert list(runtime.generate(PROMPT, N_TOKENS, GREEDY)) == local_tokens
        assert runtime.moe_stats().fallback_pairs > 0
        daemon = subprocess.Popen([sys.executable, "-P", "-m", "moerun", "daemon", "-m", str(model),
                                   "--listen", endpoint], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: link.rejoins == 1, REJOIN_TIMEOUT_S, "rejoin of the daemon started late")
            remote_before = runtime.moe_stats().remote_pairs
            assert list(runtime.generate(PROMPT, N_TOKENS, GREEDY)) == local_tokens
            assert runtime.moe_stats().remote_pairs > remote_before and link.up
        finally:
            runtime.close()
            daemon.terminate()
            daemon.wait(10)
    log = capfd.readouterr().err
    assert log.count(f"daemon d0 {endpoint} is unreachable at start: the connection to "
                     f"{endpoint.removeprefix('tcp://')} was refused") == 1


def test_with_require_daemons_an_unreachable_daemon_is_a_clear_error(model, tmp_path):
    started = time.monotonic()
    with pytest.raises(RigError, match="daemon d0 ipc://.*nobody.sock: no socket file at .*nobody.sock"):
        Runtime(model, rig=RigConfig(daemons=(f"ipc://{tmp_path}/nobody.sock",), daemon_timeout_s=2,
                                     require_daemons=True))
    assert time.monotonic() - started < 10


