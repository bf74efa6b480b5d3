"""A DEALER's monitor never stalls the ZeroMQ context it lives in. ZeroMQ sends socket events
from the context's I/O thread, and a blocked send there stops every socket of the context:
a parent that restarted a dead daemon, or retried one for a long while, could then greet no
daemon at all (the restarted one waited out its 300 s HELLO timeout). Real sockets: a socket
file nobody listens on, a daemon served in a thread."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import zmq
from zmq.utils.monitor import recv_monitor_message

from moerun.ipc.client import DaemonClient
from moerun.ipc.dealer_monitor import DealerMonitor
from moerun.ipc.server import Server
from moerun.ipc.sockets import new_dealer
from tests.support.fake_daemon import FINGERPRINT, FakeHandler

GREETING_TIMEOUT_S = 10.0
ZMQ_DEFAULT_QUEUE = 2000        # a monitor's queue with ZeroMQ's default bounds (1000 each side)


@contextmanager
def context():
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


@contextmanager
def served(endpoint: str):
    server = Server(endpoint, FakeHandler(FINGERPRINT, 0.0))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.stop()
        thread.join(10)
        assert not thread.is_alive(), "the daemon's loop did not stop"


def dead_socket_file(folder) -> str:
    """An ipc:// endpoint whose socket file nobody listens on: each attempt is refused."""
    path = folder / "dead.sock"
    with socket.socket(socket.AF_UNIX) as gone:
        gone.bind(str(path))
    return f"ipc://{path}"


def greets_on(ctx: zmq.Context, endpoint: str) -> bool:
    """Whether a new client on `ctx` gets a HELLO reply from the daemon at `endpoint`."""
    with served(endpoint):
        parent = DaemonClient(endpoint, context=ctx, connect_timeout_s=GREETING_TIMEOUT_S)
        try:
            return parent.hello(FINGERPRINT)["fingerprint"] == FINGERPRINT
        finally:
            parent.close()


def test_events_after_the_monitor_closed_do_not_block_the_context(tmp_path):
    """The DEALER keeps retrying for a while after its monitor closed (as it does between
    DaemonClient.close's two steps on a loaded machine): its retries must not block."""
    with context() as ctx:
        dealer = new_dealer(ctx)
        monitor = DealerMonitor(dealer, "dead", None)
        dealer.connect(dead_socket_file(tmp_path))
        time.sleep(0.3)
        monitor.close()
        time.sleep(1.5)                       # retries at 100 ms..1 s: events after the close
        dealer.close(linger=0)
        assert greets_on(ctx, f"ipc://{tmp_path}/live.sock")


def test_events_nobody_reads_do_not_block_the_context(tmp_path):
    """A dead daemon retried for long (here every millisecond) while the parent reads nothing."""
    with context() as ctx:
        dealer = new_dealer(ctx)
        dealer.setsockopt(zmq.RECONNECT_IVL, 1)
        dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 1)
        monitor = DealerMonitor(dealer, "dead", None)
        dealer.connect(dead_socket_file(tmp_path))
        try:
            time.sleep(4.0)                   # some 2 events a retry
            assert greets_on(ctx, f"ipc://{tmp_path}/live.sock")
            queued = 0
            while monitor.events.poll(0):
                recv_monitor_message(monitor.events)
                queued += 1
            assert queued > ZMQ_DEFAULT_QUEUE, f"only {queued} events came: the test did not reach the bound"
        finally:
            monitor.close()
            dealer.close(linger=0)
