"""A parent's client against daemons that cannot serve it: nothing listens at the address, no
socket file, a CURVE daemon that refuses the handshake, another model, another parent. Each is
one clear error at once, well inside a connect timeout of 30 s; a daemon that listens later is
greeted on the same client. Real ZeroMQ sockets: fake daemons in child processes, CURVE
daemons served in a thread of this process."""
from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from moerun.ipc import protocol as p
from moerun.ipc.client import DaemonClient, DaemonError, DaemonUnreachable
from moerun.ipc.curve import CurveClientKeys, CurveServerKeys
from moerun.ipc.server import Server
from tests.support.curve_keys import rig_key_folder
from tests.support.fake_daemon import FINGERPRINT, FakeHandler, daemon_process
from tests.support.live_processes import tcp_endpoint

CONNECT_TIMEOUT_S = 30.0
AT_ONCE_S = 5.0               # far inside the connect timeout, even on a loaded machine


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    return rig_key_folder(tmp_path_factory.mktemp("keys"))


def parent_keys(keys: Path, parent: str = "parent", daemon: str = "daemon") -> CurveClientKeys:
    return CurveClientKeys.from_files(keys / f"{parent}.key_secret", keys / f"{daemon}.key")


@contextmanager
def served(endpoint: str, curve: CurveServerKeys | None = None, fingerprint: str = FINGERPRINT):
    """A daemon (the fake handler) serving `endpoint` in a thread; stopped and closed at the end."""
    server = Server(endpoint, FakeHandler(fingerprint, 0.0), curve=curve)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(10)
        assert not thread.is_alive(), "the daemon's loop did not stop"


@contextmanager
def client(endpoint: str, **kwargs):
    parent = DaemonClient(endpoint, connect_timeout_s=CONNECT_TIMEOUT_S, **kwargs)
    try:
        yield parent
    finally:
        parent.close()


def refused_at_once(parent: DaemonClient, error: type[Exception], fingerprint: str = FINGERPRINT, **hello):
    """The error hello() raises, and that it came within AT_ONCE_S."""
    started = time.monotonic()
    with pytest.raises(error) as caught:
        parent.hello(fingerprint, **hello)
    assert time.monotonic() - started < AT_ONCE_S, f"{caught.value} came after {time.monotonic() - started:.1f} s"
    return caught.value


def test_nothing_listening_at_a_tcp_address_is_found_at_once():
    endpoint = tcp_endpoint()
    with client(endpoint, expect_listening=True) as parent:
        error = refused_at_once(parent, DaemonUnreachable)
    assert str(error) == (f"daemon {endpoint}: the connection to {endpoint.removeprefix('tcp://')} was refused or "
                          f"the host is unreachable: no daemon listens there")


def test_no_socket_file_at_an_ipc_path_is_found_at_once(tmp_path):
    path = tmp_path / "nobody.sock"
    with client(f"ipc://{path}", expect_listening=True) as parent:
        error = refused_at_once(parent, DaemonUnreachable)
    assert f"no socket file at {path}, so no daemon listens there" in str(error)


def test_a_socket_file_nobody_listens_on_is_found_at_once(tmp_path):
    path = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as gone:        # a daemon that exited without removing its file
        gone.bind(str(path))
    with client(f"ipc://{path}", expect_listening=True) as parent:
        error = refused_at_once(parent, DaemonUnreachable)
    assert error.reason == f"{path} refuses connections: the daemon that listened there has exited"


def test_the_client_that_found_nobody_greets_the_daemon_that_listens_later(tmp_path):
    endpoint = f"ipc://{tmp_path}/late.sock"
    with client(endpoint, expect_listening=True) as parent:
        refused_at_once(parent, DaemonUnreachable)
        with served(endpoint):
            assert parent.hello(FINGERPRINT)["fingerprint"] == FINGERPRINT
            parent.bye()


def test_a_daemon_that_may_still_be_starting_is_waited_for(tmp_path):
    """Without expect_listening (a daemon this parent just spawned) a refused connection is
    tried again until the daemon answers."""
    endpoint = f"ipc://{tmp_path}/starting.sock"
    with client(endpoint) as parent, daemon_process(endpoint=endpoint):   # it listens a moment later
        assert parent.hello(FINGERPRINT)["fingerprint"] == FINGERPRINT
        parent.bye()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_parent_key_the_daemon_does_not_authorize_is_refused_at_once(keys, tmp_path, transport):
    endpoint = tcp_endpoint() if transport == "tcp" else f"ipc://{tmp_path}/curve.sock"
    with served(endpoint, CurveServerKeys.from_files(keys / "daemon.key_secret", keys / "parents")), \
            client(endpoint, curve=parent_keys(keys, "stranger"), expect_listening=True) as parent:
        error = refused_at_once(parent, DaemonError)
    stranger = parent_keys(keys, "stranger").public_key.decode()
    assert error.code == p.UNAUTHENTICATED
    assert error.message == (f"the daemon does not authorize this parent's CURVE public key {stranger}: add this "
                             f"parent's .key file to the daemon's --curve-authorized-keys (its log names the key "
                             f"it refused)")


def test_a_refusal_before_the_client_looks_is_still_seen(keys, monkeypatch):
    """The DEALER's monitor is attached before it connects: a handshake refused while the parent's
    thread is held up (a loaded machine) is still reported, not waited out."""
    import moerun.ipc.dealer_monitor as dealer_monitor

    endpoint = tcp_endpoint()
    watch = dealer_monitor.DealerMonitor.__init__

    def held_up(self, *args, **kwargs):
        time.sleep(1.0)                     # long enough for a handshake on loopback to be refused
        watch(self, *args, **kwargs)

    monkeypatch.setattr(dealer_monitor.DealerMonitor, "__init__", held_up)
    with served(endpoint, CurveServerKeys.from_files(keys / "daemon.key_secret", keys / "parents")), \
            client(endpoint, curve=parent_keys(keys, "stranger"), expect_listening=True) as parent:
        assert refused_at_once(parent, DaemonError).code == p.UNAUTHENTICATED


def test_a_parent_without_keys_is_told_the_daemon_runs_curve(keys):
    endpoint = tcp_endpoint()
    with served(endpoint, CurveServerKeys.from_files(keys / "daemon.key_secret", keys / "parents")), \
            client(endpoint, expect_listening=True) as parent:
        error = refused_at_once(parent, DaemonError)
    assert error.code == p.UNAUTHENTICATED
    assert error.message.startswith("the daemon authenticates its parents with CURVE and this parent has no keys "
                                    "for it: give it --curve-secret-key FILE and --daemon-public-key FILE")


def test_a_parent_with_another_daemons_public_key_is_told_so(keys):
    endpoint = tcp_endpoint()
    with served(endpoint, CurveServerKeys.from_files(keys / "daemon.key_secret", keys / "parents")), \
            client(endpoint, curve=parent_keys(keys, daemon="other-daemon"), expect_listening=True) as parent:
        error = refused_at_once(parent, DaemonError)
    other = CurveClientKeys.from_files(keys / "parent.key_secret", keys / "other-daemon.key").server_public_key
    assert error.code == p.UNAUTHENTICATED
    assert error.message.startswith(f"the daemon hung up during the CURVE handshake: the public key this parent "
                                    f"holds for it ({other.decode()}) is not that daemon's (give its own .key file)")


def test_a_parent_with_keys_is_told_the_daemon_may_run_without_curve(keys):
    """libzmq tells the mechanism mismatch, or (now and then) has the daemon hang up first."""
    endpoint = tcp_endpoint()
    with served(endpoint), client(endpoint, curve=parent_keys(keys), expect_listening=True) as parent:
        error = refused_at_once(parent, DaemonError)
    assert error.code == p.UNAUTHENTICATED
    assert "the daemon runs without CURVE" in error.message


def test_the_refused_socket_is_replaced_so_a_later_greeting_is_judged_again(keys):
    """After a refused handshake ZeroMQ never connects that socket again: the next greeting
    opens a new one, and is refused again (not left to time out)."""
    endpoint = tcp_endpoint()
    with served(endpoint, CurveServerKeys.from_files(keys / "daemon.key_secret", keys / "parents")), \
            client(endpoint, curve=parent_keys(keys, "stranger"), expect_listening=True) as parent:
        for _ in range(2):
            assert refused_at_once(parent, DaemonError).code == p.UNAUTHENTICATED


def test_the_authorized_parent_is_served(keys):
    endpoint = tcp_endpoint()
    with served(endpoint, CurveServerKeys.from_files(keys / "daemon.key_secret", keys / "parents")), \
            client(endpoint, curve=parent_keys(keys), expect_listening=True) as parent:
        assert parent.hello(FINGERPRINT)["fingerprint"] == FINGERPRINT
        parent.bye()


def listening(parent: DaemonClient) -> DaemonClient:
    """Once the daemon (still starting) answers: STATS is answered for anyone."""
    parent.stats(timeout_s=60)
    return parent


def test_a_daemon_of_another_model_names_both_files():
    with daemon_process("--fingerprint", "model-B") as daemon, client(daemon.endpoint) as parent:
        error = refused_at_once(listening(parent), DaemonError, "model-A", model="/models/a.gguf")
        log = daemon.wait_for_log("fingerprint mismatch")
    expected = ("model fingerprint mismatch: parent expects 'model-A', daemon has 'model-B' (the parent runs "
                "/models/a.gguf, the daemon serves fake: give both the same GGUF file)")
    assert (error.code, error.message) == (p.FINGERPRINT_MISMATCH, expected)
    assert expected in log


def test_a_daemon_serving_another_parent_names_that_parent():
    with daemon_process() as daemon, client(daemon.endpoint) as first, client(daemon.endpoint) as second:
        first.hello(FINGERPRINT)
        error = refused_at_once(listening(second), DaemonError)
        first.bye()
    assert error.code == p.BUSY
    assert error.message.startswith(f"serving parent pid {os.getpid()} on {socket.gethostname()} since ")
    assert "another parent gets it once that one ends its session or exits, or after 30 s of silence" in error.message


class RecordedContext(zmq.Context):
    made: list[zmq.Context] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        RecordedContext.made.append(self)


@pytest.fixture
def contexts(monkeypatch) -> list[zmq.Context]:
    """Every zmq.Context made while the test runs (what the product makes, through zmq.Context)."""
    RecordedContext.made = []
    monkeypatch.setattr(zmq, "Context", RecordedContext)
    return RecordedContext.made


def test_a_client_that_cannot_connect_leaves_no_context_open(contexts):
    with pytest.raises(zmq.ZMQError):
        DaemonClient("tcp://no-port-given", connect_timeout_s=1)
    assert contexts and all(context.closed for context in contexts)


def test_a_daemon_that_cannot_bind_leaves_no_context_or_thread(keys, contexts):
    """Its CURVE guard's thread had started: closing the context ends it, which closes its sockets."""
    with served(tcp_endpoint()) as taken:
        threads = threading.active_count()
        started = time.monotonic()
        with pytest.raises(zmq.ZMQError):
            Server(taken.endpoint, FakeHandler(FINGERPRINT, 0.0),
                   curve=CurveServerKeys.from_files(keys / "daemon.key_secret", keys / "parents"))
        assert time.monotonic() - started < AT_ONCE_S
        deadline = time.monotonic() + AT_ONCE_S
        while threading.active_count() > threads:
            assert time.monotonic() < deadline, "the CURVE guard's thread outlived its context"
            time.sleep(0.01)
    assert all(context.closed for context in contexts)
