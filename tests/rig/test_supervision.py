"""Supervision with real daemon processes: a daemon that dies or hangs costs speed, never the
answer; it is brought back in the background and its experts move back to it; heartbeats
find failures while the parent is idle; closing the rig ends every restart loop."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from moerun.engine.report import stats_document, stats_table
from moerun.engine.runtime import RunStats, Runtime
from moerun.ipc.client import DaemonClient
from moerun.rig import supervisor as rig_module
from moerun.rig.links import RigError
from moerun.rig.settings import RigConfig
from moerun.rig.supervisor import HEARTBEAT_S
from tests.support.daemon_fixtures import (
    GREEDY,
    N_TOKENS,
    PROMPT,
    fault_free_tokens,
    tiny_daemon_model,
    wait_for_socket,
)
from tests.support.live_processes import (
    REJOIN_TIMEOUT_S,
    live_children,
    wait_until,
)

STAMPED_LINE = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d moerun: "


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_daemon_model(tmp_path_factory.mktemp("supervision"))


@pytest.fixture(scope="module")
def local_tokens(model):
    return fault_free_tokens(model)


@contextmanager
def daemon_process(model: Path, endpoint: str, log_path: Path):
    """A `moerun daemon` started by hand, as a user or systemd would; killed at the end."""
    socket_path = Path(endpoint.removeprefix("ipc://"))
    socket_path.unlink(missing_ok=True)         # a killed predecessor leaves its socket file
    with log_path.open("ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "moerun", "daemon", "-m", str(model), "--device", "cpu",
                                    "--listen", endpoint], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        wait_for_socket(socket_path, process)
        yield process
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()


@pytest.mark.parametrize("transport", ["shared", "stream"])
def test_kill_9_mid_generation_falls_back_then_the_daemon_rejoins(model, local_tokens, transport, capfd):
    rig = RigConfig(daemons=("cpu", "cpu"), hot=1, transport=transport, daemon_timeout_s=20)
    with Runtime(model, rig=rig) as runtime:
        link = runtime.rig.links[0]
        killed = link.local.process.pid
        tokens, stats = [], RunStats()
        for token in runtime.generate(PROMPT, N_TOKENS, GREEDY, stats=stats):
            tokens.append(token)
            if len(tokens) == 4:
                os.kill(killed, signal.SIGKILL)
            if len(tokens) == 8:
                wait_until(lambda: link.rejoins == 1, REJOIN_TIMEOUT_S, "rejoin")
                calls, fallbacks = link.client.counters.calls, link.fallback_calls
        document = stats_document(runtime, stats)
        assert link.local.process.pid != killed
    assert tokens == local_tokens
    d0 = document["daemons"][0]
    assert (d0["state"], d0["times_down"], d0["restarts"], d0["rejoins"]) == ("up", 1, 1, 1)
    assert fallbacks > 0 and document["fallback_pairs"] > 0
    assert d0["calls"] > calls and d0["fallback_calls"] == fallbacks, "the rejoined daemon serves its experts again"
    assert re.search(rf"^d0 cpu .* {fallbacks} +1 +1 +1  up$", stats_table(document), re.M)
    log = capfd.readouterr().err
    assert re.search(STAMPED_LINE + "daemon d0 cpu died; the parent computes its experts until it rejoins", log, re.M)
    assert re.search(STAMPED_LINE + "daemon d0 cpu rejoined as pid", log, re.M)


def test_sigstop_of_a_spawned_daemon_falls_back_and_a_new_process_rejoins(model, local_tokens):
    rig = RigConfig(daemons=("cpu",), hot=1, daemon_timeout_s=1.0)
    with Runtime(model, rig=rig) as runtime:
        link = runtime.rig.links[0]
        stopped = link.local.process.pid
        tokens = []
        for token in runtime.generate(PROMPT, N_TOKENS, GREEDY):
            tokens.append(token)
            if len(tokens) == 4:
                os.kill(stopped, signal.SIGSTOP)
            if len(tokens) == 8:
                assert link.down_reason == "did not answer within 1 s"
                wait_until(lambda: link.rejoins == 1, REJOIN_TIMEOUT_S, "rejoin")
                calls = link.client.counters.calls
        assert link.client.counters.calls > calls
        assert not Path(f"/proc/{stopped}").exists(), "the hung process was killed and reaped"
    assert tokens == local_tokens


@pytest.mark.parametrize("transport", ["shared", "stream"])
def test_sigstop_of_a_connected_daemon_then_sigcont_rejoins(model, local_tokens, tmp_path, transport):
    endpoint = f"ipc://{tmp_path}/d0.sock"
    with daemon_process(model, endpoint, tmp_path / "d0.log") as daemon:
        rig = RigConfig(daemons=(endpoint,), hot=1, transport=transport, daemon_timeout_s=1.0)
        with Runtime(model, rig=rig) as runtime:
            link = runtime.rig.links[0]
            tokens = []
            for token in runtime.generate(PROMPT, N_TOKENS, GREEDY):
                tokens.append(token)
                if len(tokens) == 4:
                    os.kill(daemon.pid, signal.SIGSTOP)
                if len(tokens) == 8:
                    assert link.down_reason == "did not answer within 1 s" and link.fallback_calls > 0
                    os.kill(daemon.pid, signal.SIGCONT)
                    wait_until(lambda: link.rejoins == 1, REJOIN_TIMEOUT_S, "rejoin")
                    calls, fallbacks = link.client.counters.calls, link.fallback_calls
            assert link.client.counters.calls > calls and link.fallback_calls == fallbacks
            assert (link.restarts, link.transport) == (0, transport)
        assert daemon.poll() is None, "the same daemon process serves again"
    assert tokens == local_tokens


def test_connected_daemon_restarted_by_its_owner_rejoins(model, local_tokens, tmp_path):
    endpoint = f"ipc://{tmp_path}/d0.sock"
    with ExitStack() as daemons:
        first = daemons.enter_context(daemon_process(model, endpoint, tmp_path / "d0.log"))
        with Runtime(model, rig=RigConfig(daemons=(endpoint,), hot=1, daemon_timeout_s=1.0)) as runtime:
            link = runtime.rig.links[0]
            tokens = []
            for token in runtime.generate(PROMPT, N_TOKENS, GREEDY):
                tokens.append(token)
                if len(tokens) == 4:
                    first.kill()
                if len(tokens) == 8:
                    assert not link.up
                    daemons.enter_context(daemon_process(model, endpoint, tmp_path / "d0.log"))
                    wait_until(lambda: link.rejoins == 1, REJOIN_TIMEOUT_S, "rejoin")
                    calls = link.client.counters.calls
            assert link.client.counters.calls > calls
    assert tokens == local_tokens


@pytest.mark.slow
def test_idle_heartbeats_find_a_hung_daemon_which_rejoins_after_sigcont(model, local_tokens, tmp_path):
    endpoint = f"ipc://{tmp_path}/d0.sock"
    with daemon_process(model, endpoint, tmp_path / "d0.log") as daemon, \
            Runtime(model, rig=RigConfig(daemons=(endpoint,), hot=1, daemon_timeout_s=1.0)) as runtime:
        link = runtime.rig.links[0]
        heard = link.client.last_heard
        wait_until(lambda: link.client.last_heard > heard + HEARTBEAT_S, 10, "heartbeat reply while idle")
        os.kill(daemon.pid, signal.SIGSTOP)
        wait_until(lambda: not link.up, 10, "hung daemon marked down while idle")
        assert link.down_reason == "did not answer within 1 s"
        os.kill(daemon.pid, signal.SIGCONT)
        wait_until(lambda: link.rejoins == 1, REJOIN_TIMEOUT_S, "rejoin")
        assert list(runtime.generate(PROMPT, N_TOKENS, GREEDY)) == local_tokens
        assert link.client.counters.calls > 0 and link.fallback_calls == 0


def test_idle_spawned_daemon_that_dies_is_restarted_before_it_is_needed(model, local_tokens):
    with Runtime(model, rig=RigConfig(daemons=("cpu",), hot=1)) as runtime:
        link = runtime.rig.links[0]
        os.kill(link.local.process.pid, signal.SIGKILL)
        wait_until(lambda: link.rejoins == 1, REJOIN_TIMEOUT_S, "rejoin")
        assert (link.times_down, link.restarts, link.down_reason) == (1, 1, None)
        assert list(runtime.generate(PROMPT, N_TOKENS, GREEDY)) == local_tokens
        assert link.client.counters.calls > 0 and link.fallback_calls == 0


@pytest.mark.parametrize("transport", ["shared", "stream"])
def test_heartbeats_between_layers_leave_compute_alone(model, local_tokens, transport, monkeypatch):
    """With a 1 ms heartbeat the watchers ping whenever the generation thread lets go of a
    daemon, between a request and its reply too; the answers and the daemons stay as they were."""
    pings = []
    ping = DaemonClient.ping
    monkeypatch.setattr(DaemonClient, "ping", lambda client, *args: pings.append(ping(client, *args)))
    monkeypatch.setattr(rig_module, "HEARTBEAT_S", 0.001)
    with Runtime(model, rig=RigConfig(daemons=("cpu", "cpu"), hot=1, transport=transport)) as runtime:
        generations, deadline = 0, time.monotonic() + 60
        while generations < 3 or (len(pings) <= 20 and time.monotonic() < deadline):  # slow machines ping less
            assert list(runtime.generate(PROMPT, N_TOKENS, GREEDY)) == local_tokens
            generations += 1
        assert all(link.up and link.times_down == 0 and link.fallback_calls == 0 for link in runtime.rig.links)
    assert len(pings) > 20


def test_require_daemons_stops_at_a_daemon_that_died_while_idle(model):
    with Runtime(model, rig=RigConfig(daemons=("cpu",), hot=1, require_daemons=True)) as runtime:
        link = runtime.rig.links[0]
        os.kill(link.local.process.pid, signal.SIGKILL)
        wait_until(lambda: not link.up, 10, "dead daemon marked down while idle")
        with pytest.raises(RigError, match=r"daemon d0 cpu died \(--require-daemons is set\)"):
            list(runtime.generate(PROMPT, N_TOKENS, GREEDY))
        assert link.restarts == 0


@pytest.mark.slow
def test_closing_the_rig_ends_its_restart_loop(model, tmp_path, capfd):
    """A daemon that cannot start again (its model file moved away) is retried with growing
    back-off; closing the rig stops the retries at once and leaves no process or thread."""
    path = tmp_path / "m.gguf"
    path.write_bytes(model.read_bytes())
    threads, children = threading.active_count(), live_children()
    runtime = Runtime(path, rig=RigConfig(daemons=("cpu",), hot=1))
    try:
        link = runtime.rig.links[0]
        path.rename(tmp_path / "moved.gguf")             # the parent keeps its mapping; a new daemon cannot open it
        os.kill(link.local.process.pid, signal.SIGKILL)
        wait_until(lambda: link.restarts >= 3, REJOIN_TIMEOUT_S, "third restart")
    finally:
        closing = time.monotonic()
        runtime.close()
    assert time.monotonic() - closing < 5
    assert (threading.active_count(), live_children()) == (threads, children)
    assert link.rejoins == 0
    log = capfd.readouterr().err
    failures = re.findall(STAMPED_LINE + r"daemon d0 cpu did not rejoin \(next try in (\d+) s\): daemon cpu exited "
                          r"while starting \(status 1\):\nError: .*m.gguf: file does not exist\n", log, re.M)
    assert failures[:2] == ["1", "2"], "back-off doubles; each failure quotes that process's own stderr"
