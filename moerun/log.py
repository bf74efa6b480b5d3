"""moerun's one logger. Every module logs through `logging.getLogger(__name__)` (the "moerun"
tree; moerun.ipc, which imports nothing else of moerun, does the same), and one handler writes
each record as one stamped line on the stderr of the moment:

    2026-11-24 10:00:00 moerun: daemon d0 cpu died; ...            (the parent)
    2026-11-24 10:00:00 moerun-daemon[4242] session start: ...     (an expert daemon)
"""
from __future__ import annotations

import logging
import sys

ROOT = "moerun"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
PARENT_FORMAT = "%(asctime)s moerun: %(message)s"
DAEMON_FORMAT = "%(asctime)s moerun-daemon[%(process)d] %(message)s"


class StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (tests and servers swap it)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter(PARENT_FORMAT, DATE_FORMAT))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def install() -> None:
    """Give the "moerun" logger its handler, once per process (imported with moerun)."""
    logger = logging.getLogger(ROOT)
    if not any(isinstance(handler, StderrHandler) for handler in logger.handlers):
        logger.addHandler(StderrHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False


def use_daemon_format() -> None:
    """Stamp lines as an expert daemon's, with its pid."""
    for handler in logging.getLogger(ROOT).handlers:
        if isinstance(handler, StderrHandler):
            handler.setFormatter(logging.Formatter(DAEMON_FORMAT, DATE_FORMAT))
