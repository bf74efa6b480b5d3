"""Every zmq.Context made while a test runs is closed by the end of that test, or of the fixture
that made it; one left open fails that test and is destroyed with linger 0.

A context left to the garbage collector can hang the run: when it and its socket are in one
cycle, the collector clears the context's weak set of sockets before the finalizers run, so
Context.__del__ -> destroy() closes nothing and term() blocks on the still-open socket. So the
ledger holds every context made during a test until its owner ends (the collector never meets
it), and then closes what its owner left open. Its sockets default to linger 0 (ZMQ_BLOCKY off),
as every socket of moerun's sets, so that one the collector closed with a message still queued
cannot hold up term() either.

Registered as a plugin by tests/conftest.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import zmq
import zmq.utils.garbage


@dataclass(frozen=True)
class Owner:
    """What a context was made in: a test, or a fixture (which may outlive the test)."""

    name: str
    ended: Callable[[], bool]


class ContextLedger:
    def __init__(self):
        self.owner: Owner | None = None              # who makes contexts now; None: no test
        self.contexts: list[tuple[zmq.Context, Owner]] = []

    def record(self, context: zmq.Context) -> None:
        if self.owner is not None:
            self.contexts.append((context, self.owner))

    def close_ended(self) -> list[str]:
        """Forget the contexts whose owner has ended; destroy those left open (linger 0) and
        name them. pyzmq's own context for zero-copy sends (made at the first one, it lives as
        long as the process) is not a test's."""
        leaks, still_owned = [], []
        for context, owner in self.contexts:
            if context is zmq.utils.garbage.gc._context:
                continue
            if not owner.ended():
                still_owned.append((context, owner))
            elif not context.closed:
                leaks.append(f"{context!r} made in {owner.name}")
                context.destroy(linger=0)
        self.contexts = still_owned
        return leaks


ledger = ContextLedger()
_original_init = zmq.Context.__init__


def _recording_init(context, *args, **kwargs):
    _original_init(context, *args, **kwargs)
    if not context._shadow:
        context.set(zmq.BLOCKY, False)
        ledger.record(context)


def pytest_configure(config):
    zmq.Context.__init__ = _recording_init


def pytest_unconfigure(config):
    zmq.Context.__init__ = _original_init


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    ledger.owner = Owner(f"test {item.nodeid}", ended=lambda: True)
    try:
        return (yield)
    finally:
        ledger.owner = None


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    outer = ledger.owner
    ledger.owner = Owner(f"fixture {fixturedef.argname!r}, set up for {outer.name}",
                         ended=lambda: fixturedef.cached_result is None)
    try:
        return (yield)
    finally:
        ledger.owner = outer


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's teardown (and that of the fixtures it was the last user of), fail it
    for each context their owners left open."""
    try:
        yield
    finally:
        leaks = ledger.close_ended()
    if leaks:
        pytest.fail("zmq contexts left open (destroyed with linger 0):\n  " + "\n  ".join(leaks),
                    pytrace=False)
