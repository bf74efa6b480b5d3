"""Deadlines and failures: slow, killed and stopped daemons never hang the parent, and no
shared-memory segment or child process outlives a test."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from moerun.ipc import protocol as p
from moerun.ipc.client import DaemonClient, DaemonDied, DaemonError, DaemonTimeout
from tests.support.fake_daemon import (
    FINGERPRINT,
    HIDDEN,
    daemon_process,
    expected_output,
    ramp,
    routing,
)

# A deadline the test expects to fire must fire well within SLACK_S of its time, on a loaded
# 2-core machine too; an answer that must come gets ANSWER_WITHIN_S.
SLACK_S = 1.0
ANSWER_WITHIN_S = 30.0


def connected(endpoint: str, shared: bool) -> DaemonClient:
    client = DaemonClient(endpoint, connect_timeout_s=ANSWER_WITHIN_S)
    client.hello(FINGERPRINT)
    client.assign({0: [0, 1, 2]})
    if shared:
        client.attach_shared(batch_capacity=16, hidden=HIDDEN, max_pairs_per_token=2)
    return client


def submit(client, tokens=4, seed=0):
    x = ramp(tokens, seed=seed)
    routed = routing(tokens, n_local=3, max_k=2, seed=seed)
    return client.submit(0, x, *routed, "f32"), expected_output(0, x, *routed)


@pytest.mark.parametrize("shared", [False, True])
def test_slow_daemon_times_out_and_its_late_reply_is_discarded(shared):
    with daemon_process("--sleep-s", str(0.15 + SLACK_S + 0.25)) as daemon:   # answers after the deadline
        client = connected(daemon.endpoint, shared)
        slow, _ = submit(client)
        start = time.monotonic()
        with pytest.raises(DaemonTimeout):
            client.wait(slow, timeout_s=0.15)
        assert 0.14 < time.monotonic() - start < 0.15 + SLACK_S
        request_id, expected = submit(client, seed=1)   # answered after the late one
        np.testing.assert_array_equal(client.wait(request_id, timeout_s=ANSWER_WITHIN_S), expected)
        client.bye()
        client.close()


@pytest.mark.parametrize("shared", [False, True])
def test_killed_daemon_is_reported_dead_quickly(shared):
    with daemon_process("--sleep-s", "30") as daemon:
        client = connected(daemon.endpoint, shared)
        request_id, _ = submit(client)
        time.sleep(0.1)
        os.kill(daemon.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(DaemonDied):
            client.wait(request_id, timeout_s=ANSWER_WITHIN_S, alive=daemon.alive)
        assert time.monotonic() - start < 5 * SLACK_S      # long before the 30 s deadline
        start = time.monotonic()
        client.close()
        assert time.monotonic() - start < SLACK_S


@pytest.mark.parametrize("shared", [False, True])
def test_stopped_daemon_times_out(shared):
    with daemon_process() as daemon:
        client = connected(daemon.endpoint, shared)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            request_id, expected = submit(client)
            start = time.monotonic()
            with pytest.raises(DaemonTimeout):
                client.wait(request_id, timeout_s=0.3, alive=daemon.alive)
            assert time.monotonic() - start < 0.3 + SLACK_S
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        request_id, expected = submit(client, seed=2)
        np.testing.assert_array_equal(client.wait(request_id, timeout_s=ANSWER_WITHIN_S), expected)
        client.bye()
        client.close()


def test_full_slots_with_a_stuck_daemon_time_out_in_submit():
    with daemon_process("--sleep-s", str(0.2 + SLACK_S + 0.5)) as daemon:   # no slot frees in time
        client = connected(daemon.endpoint, shared=True)
        for _ in range(4):
            submit(client)
        start = time.monotonic()
        with pytest.raises(DaemonTimeout):
            client.submit(0, ramp(1), *routing(1, n_local=3, max_k=1), "f32", timeout_s=0.2)
        assert time.monotonic() - start < 0.2 + SLACK_S
        client.close()


def test_hello_to_nobody_times_out(tmp_path):
    client = DaemonClient(f"ipc://{tmp_path}/nobody.sock", connect_timeout_s=0.4)
    start = time.monotonic()
    with pytest.raises(DaemonTimeout, match="no HELLO reply"):
        client.hello(FINGERPRINT)
    assert time.monotonic() - start < 0.4 + SLACK_S
    client.close()


def test_hello_waits_for_a_daemon_that_is_still_starting(tmp_path):
    endpoint = f"ipc://{tmp_path}/late.sock"
    client = DaemonClient(endpoint, connect_timeout_s=ANSWER_WITHIN_S)
    with daemon_process(endpoint=endpoint) as daemon:
        assert client.hello(FINGERPRINT)["pid"] == daemon.pid
        client.bye()
    client.close()


def test_sigterm_ends_the_daemon_cleanly_mid_session():
    with daemon_process() as daemon:
        client = connected(daemon.endpoint, shared=True)
        daemon.process.terminate()
        assert daemon.process.wait(ANSWER_WITHIN_S) == 0
        assert "session end" in daemon.log()
        with pytest.raises(DaemonError) as error:   # the arena was detached
            client.wait(submit(client)[0], timeout_s=2, alive=daemon.alive)
        assert error.value.code == p.NO_SESSION
        client.close()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


@pytest.mark.parametrize("shared", [False, True])
def test_idle_daemon_sleeps(shared):
    with daemon_process() as daemon:
        client = connected(daemon.endpoint, shared)
        for seed in range(20):
            request_id, _ = submit(client, seed=seed)
            client.wait(request_id, timeout_s=ANSWER_WITHIN_S)
        time.sleep(0.05)
        before = cpu_seconds(daemon.pid)
        time.sleep(0.6)
        assert cpu_seconds(daemon.pid) - before < 0.05   # under 10% of a core while idle
        client.bye()
        client.close()
