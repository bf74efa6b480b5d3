"""The base of every error moerun raises on purpose. Its message is written for the user: the
commands print it as one `Error:` line, the server answers it in its API's error shape, a daemon
sends it back as a structured error reply. Anything else that escapes is a bug, shown with its
traceback.

The bottom of the package layering: moerun.ipc may import it, it imports nothing.
"""
from __future__ import annotations


class MoerunError(Exception):
    """An error moerun raises on purpose, its message meant for the user."""


class UsageError(MoerunError, ValueError):
    """A value moerun cannot use: a flag, a config key, a size, a file's contents, a request's
    field. Also a ValueError, which code checking values catches."""
