"""CURVE between parents and a real `moerun daemon` process: authorized parents are served,
clients without CURVE, with an unknown key or with the wrong daemon key are refused and the
daemon logs why; a daemon that other hosts could reach will not start without keys; ipc://
sockets are private to their owner."""
from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import zmq
from click.testing import CliRunner

from moerun.commands.keys import keys
from moerun.gguf.reader import GGUFFile
from moerun.ipc import curve_guard
from moerun.ipc.curve import (
    CurveClientKeys,
    CurveKeyError,
    reachable_from_other_hosts,
    server_keys_for,
)
from moerun.ipc.curve_guard import RepeatFilter, describe_peer
from moerun.ipc.protocol import PROTOCOL_VERSION
from moerun.ipc.sockets import bind_router, new_dealer
from moerun.writers.synthetic import SyntheticConfig, write_synthetic_model
from tests.support.live_processes import free_port, tcp_endpoint

ANSWER_WITHIN_MS = 30_000    # a HELLO reply that must come, on a loaded machine too
REFUSED_AFTER_MS = 1500      # no reply by then: refused (each refusal is also read in the log)
TINY = SyntheticConfig(name="auth-test", n_layers=2, hidden=64, n_heads=2, n_kv_heads=1, head_dim=32,
                       n_experts=4, n_experts_used=2, expert_ff=32, vocab_size=300)
SERVE = ("import sys; from moerun.daemons.daemon import serve; "
         "serve(sys.argv[1], 'cpu', sys.argv[2], None, sys.argv[3], sys.argv[4])")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth-model") / "tiny.gguf"
    return write_synthetic_model(path, TINY, "experts answer the parent. " * 40, bigram_head=False)


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory):
    """Pairs made by `moerun keys`: the daemon's, an authorized parent's, and a stranger's."""
    folder = tmp_path_factory.mktemp("auth-keys")
    for where, name in [("daemon", "daemon"), ("parents", "parent"), ("strangers", "stranger")]:
        result = CliRunner().invoke(keys, ["-o", str(folder / where), "--name", name])
        assert result.exit_code == 0, result.output
    return folder


class Daemon:
    def __init__(self, endpoint: str, process: subprocess.Popen, log_path: Path):
        self.endpoint, self.process, self.log_path = endpoint, process, log_path

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for_log(self, text: str, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            assert self.process.poll() is None, f"daemon exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"{text!r} not in the daemon log:\n{self.log()}"
            time.sleep(0.02)
        return self.log()


@contextlib.contextmanager
def curve_daemon(model: Path, endpoint: str, key_dir: Path, log_path: Path):
    """A daemon child process that serves the parents in key_dir/parents."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(model), endpoint, str(key_dir / "daemon" / "daemon.key_secret"),
             str(key_dir / "parents")], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    daemon = Daemon(endpoint, process, log_path)
    try:
        daemon.wait_for_log(f"serving {endpoint} (CURVE, 1 authorized parent keys)", timeout_s=60)
        yield daemon
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def daemon(model, key_dir, tmp_path_factory):
    with curve_daemon(model, tcp_endpoint(), key_dir, tmp_path_factory.mktemp("auth-tcp") / "daemon.log") as d:
        yield d


def client_keys(key_dir: Path, name: str = "parent", folder: str = "parents",
                daemon_key: str = "daemon/daemon.key") -> CurveClientKeys:
    return CurveClientKeys.from_files(key_dir / folder / f"{name}.key_secret", key_dir / daemon_key)


def hello_reply(endpoint: str, fingerprint: str, curve: CurveClientKeys | None,
                timeout_ms: int = ANSWER_WITHIN_MS) -> dict | None:
    """Say HELLO from a fresh DEALER; the reply header, or None when none came within timeout_ms."""
    context = zmq.Context()
    try:
        dealer = new_dealer(context, curve)
        dealer.connect(endpoint)
        parent = {"pid": os.getpid(), "hostname": "auth-test", "boot_id": ""}
        dealer.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "hello", "id": 1, "fingerprint": fingerprint,
                                   "parent": parent}))
        if not dealer.poll(timeout_ms):
            return None
        return msgpack.unpackb(dealer.recv())
    finally:
        context.destroy(linger=0)


def fingerprint(model: Path) -> str:
    with GGUFFile(model) as gguf:
        return gguf.fingerprint()


def test_an_authorized_parent_is_served(daemon, model, key_dir):
    reply = hello_reply(daemon.endpoint, fingerprint(model), client_keys(key_dir))
    assert reply is not None and reply["op"] == "hello", reply
    assert reply["fingerprint"] == fingerprint(model)
    daemon.wait_for_log("admitted a connection from 127.0.0.1 with the authorized key 'parent'")


def test_a_client_without_curve_is_refused(daemon, model):
    assert hello_reply(daemon.endpoint, fingerprint(model), None, REFUSED_AFTER_MS) is None
    log = daemon.wait_for_log("without CURVE")
    assert "refused a connection from " in log.split("without CURVE")[-2].splitlines()[-1]


def test_an_unknown_client_key_is_refused(daemon, model, key_dir):
    stranger = client_keys(key_dir, "stranger", "strangers")
    assert hello_reply(daemon.endpoint, fingerprint(model), stranger, REFUSED_AFTER_MS) is None
    daemon.wait_for_log(f"refused a connection from 127.0.0.1: its public key {stranger.public_key.decode()} "
                        f"is not among the authorized keys")


def test_a_client_with_the_wrong_daemon_key_is_refused(daemon, model, key_dir):
    wrong_daemon_key = client_keys(key_dir, daemon_key="strangers/stranger.key")
    assert hello_reply(daemon.endpoint, fingerprint(model), wrong_daemon_key, REFUSED_AFTER_MS) is None
    log = daemon.wait_for_log("the client does not have this daemon's public key")
    assert "refused a connection from 127.0.0.1:" in log


def test_a_daemon_other_hosts_can_reach_will_not_start_without_keys(model):
    port = free_port()
    result = subprocess.run([sys.executable, "-m", "moerun", "daemon", "-m", str(model),
                             "--listen", f"tcp://0.0.0.0:{port}"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"tcp://0.0.0.0:{port} can be reached from other hosts" in result.stderr
    assert "--curve-secret-key FILE and --curve-authorized-keys FILE|DIR" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("endpoint, exposed", [
    ("tcp://0.0.0.0:7070", True), ("tcp://*:7070", True), ("tcp://192.168.1.20:7070", True),
    ("tcp://eth0:7070", True), ("tcp://gpu-box.lan:7070", True), ("tcp://[::]:7070", True),
    ("tcp://127.0.0.1:7070", False), ("tcp://127.0.1.1:7070", False), ("tcp://localhost:7070", False),
    ("tcp://[::1]:7070", False), ("ipc:///run/moerun/daemon.sock", False), ("ipc://@abstract", False),
])
def test_which_endpoints_other_hosts_can_reach(endpoint, exposed):
    assert reachable_from_other_hosts(endpoint) is exposed


def test_no_router_binds_where_other_hosts_reach_it_without_keys():
    context = zmq.Context()
    try:
        with pytest.raises(CurveKeyError, match="tcp://0.0.0.0:7070 can be reached from other hosts"):
            bind_router(context, "tcp://0.0.0.0:7070", 1 << 20)
    finally:
        context.term()


def test_the_daemon_flags_go_together(tmp_path):
    assert server_keys_for("tcp://127.0.0.1:7070", None, None) is None
    with pytest.raises(CurveKeyError, match="go together"):
        server_keys_for("tcp://127.0.0.1:7070", str(tmp_path / "daemon.key_secret"), None)
    with pytest.raises(CurveKeyError, match="can be reached from other hosts"):
        server_keys_for("tcp://10.1.2.3:7070", None, None)


def test_curve_over_ipc_and_a_private_socket_file(model, key_dir, tmp_path):
    socket_dir = tmp_path / "run" / "moerun"            # the daemon makes it
    endpoint = f"ipc://{socket_dir}/daemon.sock"
    with curve_daemon(model, endpoint, key_dir, tmp_path / "daemon.log") as daemon:
        assert stat.S_IMODE(os.stat(socket_dir / "daemon.sock").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(socket_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(socket_dir.parent).st_mode) == 0o700
        assert hello_reply(endpoint, fingerprint(model), None, REFUSED_AFTER_MS) is None
        reply = hello_reply(endpoint, fingerprint(model), client_keys(key_dir))
        assert reply is not None and reply["op"] == "hello", reply
        daemon.wait_for_log(f"admitted a connection from local process {os.getpid()} (uid {os.getuid()}) "
                            f"with the authorized key 'parent'")


def test_a_retrying_client_is_logged_once_per_window(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(curve_guard, "time", SimpleNamespace(monotonic=lambda: now[0]))   # a clock the test moves
    lines: list[str] = []
    repeats = RepeatFilter(lines.append, window_s=30)
    for port in (5001, 5002, 5003):
        repeats.refused("10.0.0.7", port, "no CURVE")
        now[0] += 1
    repeats.refused("10.0.0.8", 6001, "no CURVE")
    repeats.refused("10.0.0.7", 5004, "wrong key")
    assert lines == ["refused a connection from 10.0.0.7:5001: no CURVE",
                     "refused a connection from 10.0.0.8:6001: no CURVE",
                     "refused a connection from 10.0.0.7:5004: wrong key"]
    now[0] += 29
    repeats.refused("10.0.0.7", 5005, "no CURVE")
    assert lines[-1] == "refused a connection from 10.0.0.7:5005: no CURVE (2 more like it in the last 32 s)"


def test_peers_are_named_by_address_or_local_process():
    assert describe_peer("10.0.0.7", 5001) == "10.0.0.7:5001"
    assert describe_peer("fe80::1", 5001) == "[fe80::1]:5001"
    assert describe_peer("10.0.0.7") == "10.0.0.7"
    assert describe_peer("localhost:1000:1000:4242") == "local process 4242 (uid 1000)"


def rig_with_keys(endpoint: str, key_dir: Path, parent: str, folder: str):
    from moerun.rig.settings import DaemonEntry, RigConfig
    entry = DaemonEntry(name="remote", endpoint=endpoint, curve_public_key=str(key_dir / "daemon" / "daemon.key"))
    return RigConfig(daemons=(endpoint,), daemon_entries=(entry,), hot=0, daemon_timeout_s=3, require_daemons=True,
                     client_secret_key=str(key_dir / folder / f"{parent}.key_secret"))


@pytest.mark.slow
def test_parent_connects_with_the_keys_its_config_names(model, key_dir, tmp_path):
    """The rig reads the [auth] and [[daemon]] key files: an authorized parent computes
    through the daemon, one with a stranger's key is refused and told so."""
    from moerun.engine.runtime import Runtime
    from moerun.rig.links import RigError
    ids = list(range(1, 20))
    with Runtime(model) as local:
        want = local.logits(ids)
    with curve_daemon(model, tcp_endpoint(), key_dir, tmp_path / "daemon.log") as daemon:
        with Runtime(model, rig=rig_with_keys(daemon.endpoint, key_dir, "parent", "parents")) as remote:
            got = remote.logits(ids)
            assert remote.moe_stats().remote_pairs > 0
        assert abs(got - want).max() <= 1e-5 * abs(want).max()
        with pytest.raises(RigError, match=daemon.endpoint):
            Runtime(model, rig=rig_with_keys(daemon.endpoint, key_dir, "stranger", "strangers"))
        daemon.wait_for_log("is not among the authorized keys")


SERVE_SHARD = ("import sys; from moerun.daemons.daemon import serve; "
               "serve(sys.argv[1], 'cpu', sys.argv[2], None, sys.argv[3], sys.argv[4], layers=range(1, 2), ctx=64)")


@pytest.mark.slow
def test_a_layer_shard_across_hosts_takes_the_keys_its_split_table_names(model, key_dir, tmp_path):
    """A shard on a tcp:// address serves only authorized parents; the parent reads its key from
    [auth] and the shard's public key from its [[split]] table."""
    from moerun.engine.runtime import Runtime
    from moerun.rig.links import RigError
    from moerun.rig.settings import RigConfig, SplitEntry
    ids = list(range(1, 20))
    with Runtime(model, ctx=64) as local:
        want = local.logits(ids)
    endpoint = tcp_endpoint()
    log_path = tmp_path / "shard.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-c", SERVE_SHARD, str(model), endpoint,
                                    str(key_dir / "daemon" / "daemon.key_secret"), str(key_dir / "parents")],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    shard = Daemon(endpoint, process, log_path)
    try:
        shard.wait_for_log(f"serving {endpoint} (CURVE, 1 authorized parent keys)", timeout_s=60)
        entry = SplitEntry(name="far", layer=1, endpoint=endpoint,
                           curve_public_key=str(key_dir / "daemon" / "daemon.key"))

        def rig(parent: str, folder: str) -> RigConfig:
            return RigConfig(splits=((endpoint, 1),), split_entries=(entry,), daemon_timeout_s=3,
                             client_secret_key=str(key_dir / folder / f"{parent}.key_secret"))
        with Runtime(model, ctx=64, rig=rig("parent", "parents")) as split:
            got = split.logits(ids)
        assert abs(got - want).max() <= 1e-5 * abs(want).max()
        with pytest.raises(RigError, match=f"layer shard far {endpoint} layers 1-1 did not start: .* unauthenticated"):
            Runtime(model, ctx=64, rig=rig("stranger", "strangers"))
        shard.wait_for_log("is not among the authorized keys")
    finally:
        process.terminate()
        process.wait(10)
