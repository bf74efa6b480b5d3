"""The HELLO handshake and the one-parent session: mismatches, busy, bye, lease takeover,
shutdown, and the daemon's ipc:// socket file."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from moerun.ipc import protocol as p
from moerun.ipc.client import DaemonClient, DaemonError
from tests.support.fake_daemon import (
    FINGERPRINT,
    HIDDEN,
    REPO_ROOT,
    daemon_process,
    ramp,
    routing,
)


def connected(endpoint: str, assign: bool = True) -> DaemonClient:
    client = DaemonClient(endpoint, connect_timeout_s=10)
    client.hello(FINGERPRINT)
    if assign:
        client.assign({0: [0, 1]})
    return client


def test_fingerprint_mismatch_is_clear_on_both_sides():
    with daemon_process("--fingerprint", "model-B") as daemon, \
            DaemonClient(daemon.endpoint) as client:
        with pytest.raises(DaemonError) as error:
            client.hello("model-A")
        assert error.value.code == p.FINGERPRINT_MISMATCH
        assert "'model-A'" in str(error.value) and "'model-B'" in str(error.value)
        log = daemon.wait_for_log("fingerprint mismatch")
        assert "parent expects 'model-A', daemon has 'model-B'" in log


def test_daemon_of_another_protocol_version():
    with daemon_process("--protocol-version", "2") as daemon, \
            DaemonClient(daemon.endpoint) as client:
        with pytest.raises(DaemonError) as error:
            client.hello(FINGERPRINT)
        assert error.value.code == p.VERSION_MISMATCH
        message = str(error.value)
        assert "daemon speaks version 2, parent speaks version 1" in message
        assert "parent speaks version 1, daemon speaks version 2" in message  # the daemon's words
        assert "parent speaks version 1, daemon speaks version 2" in daemon.wait_for_log("refused")


def test_parent_of_another_protocol_version(monkeypatch):
    with daemon_process() as daemon, DaemonClient(daemon.endpoint) as client:
        monkeypatch.setattr(p, "PROTOCOL_VERSION", 3)
        with pytest.raises(DaemonError) as error:
            client.hello(FINGERPRINT)
        assert error.value.code == p.VERSION_MISMATCH
        assert "daemon speaks version 1, parent speaks version 3" in str(error.value)
        assert "parent speaks version 3, daemon speaks version 1" in daemon.wait_for_log("refused")


def test_second_parent_is_busy_until_the_first_says_bye():
    with daemon_process() as daemon:
        first = connected(daemon.endpoint)
        second = DaemonClient(daemon.endpoint)
        with pytest.raises(DaemonError) as error:
            second.hello(FINGERPRINT)
        assert error.value.code == p.BUSY
        assert f"parent pid {os.getpid()} on {socket.gethostname()}" in error.value.message
        assert "busy" in daemon.wait_for_log("refused")
        with pytest.raises(DaemonError) as error:
            second.assign({0: [1]})
        assert error.value.code == p.NO_SESSION
        first.bye()
        second.hello(FINGERPRINT)
        second.assign({0: [1]})
        second.bye()
        for client in (first, second):
            client.close()
        log = daemon.log()
        assert log.count("session start") == 2 and log.count("session end") == 2


@pytest.mark.parametrize("shared", [False, True])
def test_silent_parent_loses_its_lease(shared):
    with daemon_process("--lease-s", "0.3") as daemon:
        first = connected(daemon.endpoint)
        if shared:
            first.attach_shared(batch_capacity=8, hidden=HIDDEN, max_pairs_per_token=2)
        time.sleep(0.5)
        second = connected(daemon.endpoint)
        assert "lease taken over" in daemon.wait_for_log("lease taken over")
        x = ramp(2)
        with pytest.raises(DaemonError) as error:
            first.wait(first.submit(0, x, *routing(2, 2, 1), "f32"), timeout_s=5)
        assert error.value.code == p.NO_SESSION
        second.wait(second.submit(0, x, *routing(2, 2, 1), "f32"), timeout_s=5)
        second.bye()
        first.close()
        second.close()


def test_session_of_a_killed_parent_is_taken_over_at_once():
    with daemon_process() as daemon:
        script = (f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); "
                  "from tests.ipc.test_ipc_session import connected; "
                  f"c = connected({daemon.endpoint!r}); "
                  f"c.attach_shared(batch_capacity=4, hidden={HIDDEN}, max_pairs_per_token=2); "
                  "print('ready', flush=True); sys.stdin.read()")
        parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, cwd=REPO_ROOT)
        try:
            assert parent.stdout.readline().strip() == b"ready"
            assert not any(f"moerun-{parent.pid}-" in name for name in os.listdir("/dev/shm"))
        finally:
            parent.kill()
            parent.wait(5)
        with connected(daemon.endpoint) as client:   # no lease wait: the old pid is gone
            client.bye()
        assert "its process is gone" in daemon.log()


def test_shutdown_stops_the_daemon_and_removes_its_socket():
    with daemon_process() as daemon:
        path = daemon.endpoint[len("ipc://"):]
        client = connected(daemon.endpoint)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        client.shutdown()
        client.close()
        assert daemon.process.wait(5) == 0
        assert not os.path.exists(path)
        assert "shutdown requested" in daemon.log()


def test_only_the_owner_may_shut_down():
    with daemon_process() as daemon:
        owner = connected(daemon.endpoint)
        with DaemonClient(daemon.endpoint) as other:
            with pytest.raises(DaemonError) as error:
                other.shutdown(timeout_s=5)
            assert error.value.code == p.NO_SESSION
            assert other.ping() < 1   # anyone may ping
        owner.bye()
        owner.close()
        assert daemon.alive()


def test_stale_socket_file_is_replaced_but_a_live_one_is_not(tmp_path):
    folder = tmp_path.parent / f"s{os.getpid()}"
    folder.mkdir(exist_ok=True)
    path = folder / "d.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()                      # the file stays, nobody listens
    with daemon_process(endpoint=f"ipc://{path}") as daemon:
        with connected(daemon.endpoint, assign=False) as client:
            client.bye()
        with daemon_process(endpoint=f"ipc://{path}") as intruder:
            assert intruder.process.wait(10) != 0
            assert "another process is listening" in intruder.log()
        assert daemon.alive()
        with connected(daemon.endpoint, assign=False) as client:   # still the first daemon
            assert client.info["pid"] == daemon.pid
            client.bye()
