"""Why the parent's DEALER cannot talk to a daemon, read from ZeroMQ's socket monitor.

ZeroMQ hides a failed connection from the sockets' users: a DEALER keeps reconnecting, and
after a failed handshake it has no queue to the daemon at all (a send then blocks). Its monitor
events say what happened, on the connecting side (libzmq 4.3):

- a connection attempt that failed — nothing listens at a tcp:// address, no socket file (or a
  dead one) at an ipc:// path — is CLOSED, then CONNECT_RETRIED;
- a CURVE daemon's guard refusing the parent's public key is HANDSHAKE_FAILED_AUTH (the ZAP
  status, 400);
- one side with CURVE and the other without is HANDSHAKE_FAILED_PROTOCOL (mechanism mismatch);
  after either of these the DEALER never connects again: only a new socket tries again;
- a CURVE daemon that cannot decrypt the parent's greeting (the parent holds another daemon's
  public key) hangs up: HANDSHAKE_FAILED_NO_DETAIL, on every try. A mechanism mismatch may show
  as that too, a try or two before it is told; a daemon that exits during a handshake shows it
  once; so it counts only the third time in a row.

The monitor judges only events that came after forget(): the caller forgets before each
greeting, and the DEALER's next attempt (at most RECONNECT_MAX_MS later) decides; a refused
handshake is remembered (refused_for_good), since no attempt follows it.

ZeroMQ sends each event from the context's I/O thread, and a send that cannot go through
blocks that thread, and with it every socket of the context. So the events' queue has no
bound (a DEALER that retries a dead daemon for a day queues some 170,000 events, ~125 bytes
each, until its next request reads them), and close() stops the events before it closes
their socket (an event sent to a closed monitor would block for good).
"""
from __future__ import annotations

import itertools
import os

import zmq
from zmq.utils.monitor import recv_monitor_message

from moerun.ipc import protocol as p
from moerun.ipc.curve import MAKE_KEYS_HINT, CurveClientKeys
from moerun.ipc.protocol import DaemonError, DaemonUnreachable
from moerun.ipc.sockets import ipc_path

MONITORED = (zmq.EVENT_CONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
             | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
             | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
HUNG_UP_TIMES = 3             # handshakes in a row the daemon hung up on before that is its answer
AUTHORIZED_KEYS_FLAG = "--curve-authorized-keys"
PARENT_KEY_FLAGS = "--curve-secret-key FILE and --daemon-public-key FILE"
_monitor_numbers = itertools.count()     # each monitor's inproc endpoint is new (a closed one unbinds later)


class DealerMonitor:
    def __init__(self, dealer: zmq.Socket, endpoint: str, curve: CurveClientKeys | None):
        """Start watching `dealer`, before it connects to `endpoint` with `curve` keys (or none)."""
        self.endpoint, self.curve, self.dealer = endpoint, curve, dealer
        events_endpoint = f"inproc://moerun-dealer-events-{os.getpid()}-{next(_monitor_numbers)}"
        dealer.monitor(events_endpoint, MONITORED)
        self.events = dealer.context.socket(zmq.PAIR)
        self.events.linger = 0
        self.events.rcvhwm = 0              # no bound: see the module's notes
        self.events.connect(events_endpoint)
        self._last: int | None = None      # the latest event, whenever it came
        self._hung_up = 0                  # handshakes the daemon hung up on since forget() or a success
        self.refused_for_good: DaemonError | None = None   # a refused handshake: the DEALER is done

    def forget(self) -> None:
        """Judge only what happens from now on (a refused handshake stays in refused_for_good)."""
        while (event := self._next()) is not None:
            self._fold(event, refused_is_final=False)
        self._hung_up = 0

    def failure(self, refused_is_final: bool) -> Exception | None:
        """What the events since forget() show: DaemonUnreachable for a connection attempt that
        failed (when refused_is_final: not for a daemon that may still be starting), DaemonError
        (unauthenticated) for a handshake the daemon refused; None while nothing says so."""
        while (event := self._next()) is not None:
            failure = self._fold(event, refused_is_final)
            if failure is not None:
                return failure
        return None

    def _fold(self, event: dict, refused_is_final: bool) -> Exception | None:
        """Take one event into the state; the failure it shows, if any."""
        kind, value = event["event"], event["value"]
        failure = None
        if kind == zmq.EVENT_CONNECT_RETRIED and self._last == zmq.EVENT_CLOSED and refused_is_final:
            failure = DaemonUnreachable(self.endpoint, self._nobody_listens())
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            failure = self.refused_for_good = self._refused(self._key_not_authorized(int(value)))
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            failure = self.refused_for_good = self._refused(self._protocol_error(int(value)))
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._hung_up += 1
            if self._hung_up >= HUNG_UP_TIMES:
                failure = self._refused(self._hung_up_on())
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._hung_up = 0
        self._last = kind
        return failure

    def close(self) -> None:
        """Stop the DEALER's events, then close their socket (call it before closing the DEALER)."""
        self.dealer.disable_monitor()
        self.events.close(linger=0)

    def _next(self) -> dict | None:
        try:
            return recv_monitor_message(self.events, zmq.NOBLOCK)
        except zmq.Again:
            return None

    def _refused(self, message: str) -> DaemonError:
        return DaemonError(p.UNAUTHENTICATED, message, self.endpoint)

    def _nobody_listens(self) -> str:
        path = ipc_path(self.endpoint)
        if path is None:
            where = self.endpoint.removeprefix("tcp://")
            return f"the connection to {where} was refused or the host is unreachable: no daemon listens there"
        if not os.path.exists(path):
            return (f"no socket file at {path}, so no daemon listens there (`moerun daemon --listen "
                    f"{self.endpoint}` starts one)")
        return f"{path} refuses connections: the daemon that listened there has exited"

    def _key_not_authorized(self, status: int) -> str:
        if status != 400:
            return f"the daemon could not check this parent's CURVE key (ZAP status {status}); its log says why"
        return (f"the daemon does not authorize this parent's CURVE public key {self.curve.public_key.decode()}: "
                f"add this parent's .key file to the daemon's {AUTHORIZED_KEYS_FLAG} (its log names the key "
                f"it refused)")

    def _protocol_error(self, code: int) -> str:
        if code == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH and self.curve is None:
            return self._without_keys()
        if code == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return ("the daemon runs without CURVE, and this parent connects with CURVE keys: start the daemon "
                    f"with --curve-secret-key and {AUTHORIZED_KEYS_FLAG}, or give this parent no public key "
                    "for it")
        return f"the CURVE handshake failed ({_protocol_error_name(code)})"

    def _without_keys(self) -> str:
        return (f"the daemon authenticates its parents with CURVE and this parent has no keys for it: give it "
                f"{PARENT_KEY_FLAGS} (the daemon's public key), or [auth] client_secret_key and the daemon's "
                f"curve_public_key in its config {MAKE_KEYS_HINT}")

    def _hung_up_on(self) -> str:
        if self.curve is None:       # a CURVE daemon hangs up on a client without CURVE, or tells it
            return self._without_keys()
        return (f"the daemon hung up during the CURVE handshake: the public key this parent holds for it "
                f"({self.curve.server_public_key.decode()}) is not that daemon's (give its own .key file), or "
                f"the daemon runs without CURVE")


def _protocol_error_name(code: int) -> str:
    try:
        return zmq.Event(code).name
    except ValueError:
        return hex(code)
