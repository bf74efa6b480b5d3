"""A rig whose daemons refuse it or cannot be reached, with real `moerun daemon` processes: the
parent names the true reason at once (a CURVE key the daemon does not take, another model
with both files named, another parent with its pid and host), starts without a daemon nothing
listens for (at once, not after --daemon-timeout) and takes it in once it listens; the CURVE
key flags; config names in the stats and the log; the ready time counted from the greeting;
a rig that fails to start leaves nothing behind."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from moerun.engine.runtime import Runtime
from moerun.rig.links import RigError
from moerun.rig.settings import ConfigError, RigConfig
from tests.support.curve_keys import rig_key_folder
from tests.support.daemon_fixtures import (
    GREEDY,
    N_TOKENS,
    PROMPT,
    fault_free_tokens,
    tiny_daemon_model,
)
from tests.support.hf_models import tiny_model
from tests.support.live_processes import REJOIN_TIMEOUT_S, live_children, tcp_endpoint, wait_until
from tests.support.to_gguf import write_gguf

DAEMON_TIMEOUT_S = 30.0       # what a refusal must not wait for
AT_ONCE_S = 10.0              # a refusal's whole start-up, on a loaded 2-core machine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_daemon_model(tmp_path_factory.mktemp("refusals"))


@pytest.fixture(scope="module")
def local_tokens(model):
    return fault_free_tokens(model)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    return rig_key_folder(tmp_path_factory.mktemp("keys"))


@contextmanager
def daemon_process(model: Path, endpoint: str, log_path: Path, *flags: str):
    """`moerun daemon` at `endpoint`, as a user starts it; yields once it listens; killed at the end."""
    with log_path.open("ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "moerun", "daemon", "-m", str(model), "--listen", endpoint,
                                    *flags], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while "serving " not in log_path.read_text():
            assert process.poll() is None, f"the daemon exited:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"the daemon did not start:\n{log_path.read_text()}"
            time.sleep(0.02)
        yield process
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def curve_daemon(model, keys, tmp_path_factory):
    """A daemon on loopback tcp:// that serves only the parent in keys/parents; its log path."""
    log_path = tmp_path_factory.mktemp("curve-daemon") / "daemon.log"
    endpoint = tcp_endpoint()
    with daemon_process(model, endpoint, log_path, "--curve-secret-key", str(keys / "daemon.key_secret"),
                        "--curve-authorized-keys", str(keys / "parents")):
        yield endpoint, log_path


def run_flags(model: Path, *flags) -> list[str]:
    return ["run", "-m", str(model), "--hot", "1", "-n", "4", "--temp", "0", "-p", "experts",
            "--daemon-timeout", str(DAEMON_TIMEOUT_S), *map(str, flags)]


def test_the_key_flags_connect_an_authorized_parent(moerun, model, keys, curve_daemon):
    endpoint, _ = curve_daemon
    result = moerun(*run_flags(model, "--daemon", endpoint, "--curve-secret-key", keys / "parent.key_secret",
                               "--daemon-public-key", keys / "daemon.key", "--stats"))
    assert result.exit_code == 0, result.output
    assert re.search(rf"^d0 {re.escape(endpoint)} +shared .* up$", result.stderr, re.M), result.stderr


KEY_REFUSALS = {   # the parent's flags -> what the parent says
    "an unknown parent key": (("--curve-secret-key", "stranger.key_secret", "--daemon-public-key", "daemon.key"),
                              "the daemon does not authorize this parent's CURVE public key"),
    "no keys": ((), "the daemon authenticates its parents with CURVE and this parent has no keys for it: give it "
                    "--curve-secret-key FILE and --daemon-public-key FILE"),
    "another daemon's key": (("--curve-secret-key", "parent.key_secret", "--daemon-public-key", "other-daemon.key"),
                             "the daemon hung up during the CURVE handshake: the public key this parent holds for "
                             "it"),
}


@pytest.mark.parametrize("require", [False, True], ids=["", "require-daemons"])
@pytest.mark.parametrize("refusal", KEY_REFUSALS)
def test_a_refused_curve_handshake_is_one_clear_error_at_once(moerun, model, keys, curve_daemon, refusal, require):
    endpoint, log_path = curve_daemon
    flags, said = KEY_REFUSALS[refusal]
    flags = [flag if flag.startswith("--") else keys / flag for flag in flags]
    started = time.monotonic()
    result = moerun(*run_flags(model, "--daemon", endpoint, *flags, *(["--require-daemons"] if require else [])))
    assert time.monotonic() - started < AT_ONCE_S
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: daemon d0 {endpoint}: unauthenticated: {said}"), result.stderr
    assert "refused a connection from 127.0.0.1" in log_path.read_text()


def test_the_key_flags_override_the_config_and_stand_for_its_auth_table(moerun, model, keys, curve_daemon, tmp_path):
    """A config that names a stranger's key and another daemon's: the flags win. One that names
    the daemon's key but no [auth]: --curve-secret-key gives the parent's."""
    endpoint, _ = curve_daemon
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(f'[auth]\nclient_secret_key = "{keys / "stranger.key_secret"}"\n\n'
                     f'[[daemon]]\nendpoint = "{endpoint}"\ncurve_public_key = "{keys / "other-daemon.key"}"\n')
    result = moerun(*run_flags(model, "--config", wrong, "--curve-secret-key", keys / "parent.key_secret",
                               "--daemon-public-key", keys / "daemon.key"))
    assert result.exit_code == 0, result.output
    no_auth = tmp_path / "no-auth.toml"
    no_auth.write_text(f'[[daemon]]\nendpoint = "{endpoint}"\ncurve_public_key = "{keys / "daemon.key"}"\n')
    result = moerun(*run_flags(model, "--config", no_auth, "--curve-secret-key", keys / "parent.key_secret"))
    assert result.exit_code == 0, result.output


def test_which_public_key_goes_with_which_daemon():
    """One key file for each daemon the parent connects to, daemons then shards, or one for all;
    the daemons it spawns take none."""
    each = RigConfig(daemons=("cpu", "ipc:///a.sock", "tcp://b:1"), splits=(("tcp://c:1", 1),),
                     daemon_public_keys=("a.key", "b.key", "c.key"), client_secret_key="me.key_secret")
    assert [each.curve_public_key("daemon", i) for i in range(3)] == [None, "a.key", "b.key"]
    assert each.curve_public_key("split", 0) == "c.key"
    one = RigConfig(daemons=("ipc:///a.sock", "tcp://b:1"), daemon_public_keys=("all.key",),
                    client_secret_key="me.key_secret")
    assert [one.curve_public_key("daemon", i) for i in range(2)] == ["all.key", "all.key"]


@pytest.mark.parametrize("rig, message", [
    ({"daemons": ("ipc:///a.sock", "tcp://b:1", "tcp://c:1"), "daemon_public_keys": ("a.key", "b.key")},
     "--daemon-public-key is given 2 times for the 3 daemons the parent connects to: give one for each, in the "
     "order of --daemon then --split, or one for all"),
    ({"daemons": ("cpu",), "daemon_public_keys": ("a.key",)},
     "--daemon-public-key is for the daemons the parent connects to"),
    ({"daemons": ("tcp://b:1",), "daemon_public_keys": ("b.key",), "client_secret_key": None},
     "--daemon-public-key needs this parent's own key pair: give --curve-secret-key FILE"),
])
def test_public_keys_that_match_no_daemon_are_refused(rig, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        RigConfig(**{"client_secret_key": "me.key_secret", **rig})


def test_a_daemon_of_another_model_names_both_files(model, tmp_path):
    other = write_gguf(tiny_model("qwen3moe", seed=5), tmp_path / "other.gguf", "F32")
    endpoint = f"ipc://{tmp_path}/other.sock"
    with daemon_process(other, endpoint, tmp_path / "other.log"):
        started = time.monotonic()
        with pytest.raises(RigError) as caught:
            Runtime(model, rig=RigConfig(daemons=(endpoint,), daemon_timeout_s=DAEMON_TIMEOUT_S))
        assert time.monotonic() - started < AT_ONCE_S
    assert str(caught.value).startswith(f"daemon d0 {endpoint}: fingerprint_mismatch: model fingerprint mismatch")
    assert f"(the parent runs {model}, the daemon serves {other}: give both the same GGUF file)" in str(caught.value)
    assert f"the parent runs {model}, the daemon serves {other}" in (tmp_path / "other.log").read_text()


def test_a_daemon_serving_another_parent_names_it(model, tmp_path):
    endpoint = f"ipc://{tmp_path}/owned.sock"
    with daemon_process(model, endpoint, tmp_path / "owned.log"):
        rig = RigConfig(daemons=(endpoint,), daemon_timeout_s=DAEMON_TIMEOUT_S)
        with Runtime(model, rig=rig):
            started = time.monotonic()
            with pytest.raises(RigError) as caught:
                Runtime(model, rig=rig)
            assert time.monotonic() - started < AT_ONCE_S
    assert str(caught.value).startswith(f"daemon d0 {endpoint}: busy: serving parent pid {os.getpid()} on "
                                        f"{socket.gethostname()} since ")


def test_daemons_nothing_listens_for_start_down_at_once(model, local_tokens, tmp_path):
    refused, missing = tcp_endpoint(), f"ipc://{tmp_path}/nobody.sock"
    started = time.monotonic()
    with Runtime(model, rig=RigConfig(daemons=(refused, missing), hot=1, daemon_timeout_s=DAEMON_TIMEOUT_S)) as runtime:
        assert time.monotonic() - started < AT_ONCE_S
        reasons = [link.down_reason for link in runtime.rig.links]
        assert list(runtime.generate(PROMPT, N_TOKENS, GREEDY)) == local_tokens
    assert reasons[0] == (f"is unreachable at start: the connection to {refused.removeprefix('tcp://')} was refused "
                          f"or the host is unreachable: no daemon listens there")
    assert reasons[1].startswith(f"is unreachable at start: no socket file at {tmp_path}/nobody.sock")


@pytest.mark.parametrize("where", ["tcp", "ipc"])
def test_with_require_daemons_a_daemon_nothing_listens_for_stops_the_start_at_once(model, tmp_path, where):
    endpoint = tcp_endpoint() if where == "tcp" else f"ipc://{tmp_path}/nobody.sock"
    started = time.monotonic()
    with pytest.raises(RigError, match=f"^daemon d0 {re.escape(endpoint)}: .*no daemon listens there"):
        Runtime(model, rig=RigConfig(daemons=(endpoint,), daemon_timeout_s=DAEMON_TIMEOUT_S, require_daemons=True))
    assert time.monotonic() - started < AT_ONCE_S


def test_a_daemon_found_unreachable_rejoins_once_it_listens(model, local_tokens, tmp_path):
    endpoint = f"ipc://{tmp_path}/late.sock"
    with Runtime(model, rig=RigConfig(daemons=(endpoint,), hot=1, daemon_timeout_s=DAEMON_TIMEOUT_S)) as runtime:
        link = runtime.rig.links[0]
        assert not link.up
        with daemon_process(model, endpoint, tmp_path / "late.log"):
            wait_until(lambda: link.rejoins == 1, REJOIN_TIMEOUT_S, "rejoin of the daemon that listens now")
            assert list(runtime.generate(PROMPT, N_TOKENS, GREEDY)) == local_tokens
            assert link.client.counters.calls > 0 and link.up


def test_a_configs_daemon_names_are_the_ones_the_stats_and_the_log_show(moerun, model, tmp_path, monkeypatch):
    endpoint, missing = f"ipc://{tmp_path}/box.sock", f"ipc://{tmp_path}/spare.sock"
    config = tmp_path / "rig.toml"
    config.write_text(f'[[daemon]]\nname = "box"\nendpoint = "{endpoint}"\n\n'
                      f'[[daemon]]\nname = "spare"\nendpoint = "{missing}"\n')
    monkeypatch.setenv("COLUMNS", "500")      # the table's rows on one line each
    with daemon_process(model, endpoint, tmp_path / "box.log"):
        result = moerun(*run_flags(model, "--config", config, "--stats"))
    assert result.exit_code == 0, result.output
    assert re.search(rf"^box {re.escape(endpoint)} +shared .* up$", result.stderr, re.M), result.stderr
    assert re.search(rf"^spare {re.escape(missing)} .* down: is unreachable at start", result.stderr, re.M)
    assert f"moerun: daemon spare {missing} is unreachable at start: no socket file" in result.stderr


def test_ready_counts_from_the_start_of_waiting(model, tmp_path, capfd):
    """A daemon that answers HELLO only after 1.5 s (stopped, then continued): the ready line
    counts those seconds, not only the loading after them."""
    endpoint = f"ipc://{tmp_path}/slow.sock"
    with daemon_process(model, endpoint, tmp_path / "slow.log") as daemon:
        daemon.send_signal(signal.SIGSTOP)
        threading.Timer(1.5, daemon.send_signal, (signal.SIGCONT,)).start()
        with Runtime(model, rig=RigConfig(daemons=(endpoint,), hot=1, daemon_timeout_s=DAEMON_TIMEOUT_S)):
            pass
    seconds = float(re.search(r"1 daemon\(s\) ready with \d+ experts in ([\d.]+) s", capfd.readouterr().err)[1])
    assert seconds >= 1.4


class RecordedContext(zmq.Context):
    made: list[zmq.Context] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        RecordedContext.made.append(self)


def test_a_rig_that_fails_to_start_leaves_no_process_thread_or_context(model, tmp_path, monkeypatch):
    """The second daemon's key file is missing once the first daemon's process is running: the
    error names the file, the process is stopped, every context closed."""
    monkeypatch.setattr(zmq, "Context", RecordedContext)
    RecordedContext.made = []
    threads, children = threading.active_count(), live_children()
    rig = RigConfig(daemons=("cpu", tcp_endpoint()), hot=1, client_secret_key=str(tmp_path / "gone.key_secret"),
                    daemon_public_keys=(str(tmp_path / "gone.key"),))
    with pytest.raises(ValueError, match="gone.key_secret"):
        Runtime(model, rig=rig)
    assert (threading.active_count(), live_children()) == (threads, children)
    assert RecordedContext.made and all(context.closed for context in RecordedContext.made)


def test_launch_passes_the_parents_key_flag_to_its_workload(moerun, model, keys, tmp_path):
    """launch starts a CURVE daemon from the config; the parent's secret key comes from the
    command line, so the config need not hold it."""
    endpoint = tcp_endpoint()
    config = tmp_path / "curve.toml"
    config.write_text(f'model = "{model}"\nhot = 1\n\n[[daemon]]\nname = "box"\ndevice = "cpu"\n'
                      f'endpoint = "{endpoint}"\n'
                      f'curve_secret_key = "{keys / "daemon.key_secret"}"\n'
                      f'curve_authorized_keys = "{keys / "parents"}"\ncurve_public_key = "{keys / "daemon.key"}"\n')
    result = moerun("launch", "--config", config, "--curve-secret-key", keys / "parent.key_secret", "-n", "4",
                    "--temp", "0", "--stats")
    assert result.exit_code == 0, result.output
    assert re.search(rf"^box {re.escape(endpoint)} +shared .* up$", result.stderr, re.M), result.stderr
