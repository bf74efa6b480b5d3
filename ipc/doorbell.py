"""Futex doorbells: 32-bit words in a shared mapping that one process changes and another waits on.

The waiter spins for a short window (cheap to catch back-to-back requests; after the first
YIELD_AFTER_S it yields the CPU between reads), then raises its "sleeping" word and sleeps in
FUTEX_WAIT; the other side only pays the FUTEX_WAKE syscall when that word is up. The shared
futex ops (not FUTEX_PRIVATE) work across processes.

A wake can be missed only when the store to the word and the sleeper raising its flag cross in
the CPUs' store buffers; the first sleep is therefore capped at FIRST_SLEEP_S, after which the
flag is visible and every later change wakes the sleeper at once.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import time
from collections.abc import Callable

from moerun.errors import MoerunError

SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "riscv64": 98, "ppc64le": 221, "s390x": 238}
FUTEX_WAIT = 0
FUTEX_WAKE = 1
WAKE_ALL = 0x7FFFFFFF
FIRST_SLEEP_S = 0.001
YIELD_AFTER_S = 0.00005   # spin this long before yielding the CPU between reads
WORD_MASK = 0xFFFFFFFF


class FutexUnavailable(MoerunError, RuntimeError):
    pass


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall():
    number = SYS_FUTEX.get(platform.machine())
    if platform.system() != "Linux" or number is None:
        return None, None
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32,
                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32]
    return syscall, number


_syscall, _SYS_FUTEX = _load_syscall()


def require_futex() -> None:
    if _syscall is None:
        raise FutexUnavailable(
            f"the shared transport needs Linux futexes ({platform.system()} {platform.machine()} "
            f"has none usable here); --transport stream works everywhere")


def futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the word at `address` equals `expected`, at most timeout_s (or a signal)."""
    timeout = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    if _syscall(_SYS_FUTEX, address, FUTEX_WAIT, expected, ctypes.byref(timeout), None, 0) == -1:
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(err, f"futex wait: {os.strerror(err)}")


def futex_wake(address: int, count: int = WAKE_ALL) -> None:
    if _syscall(_SYS_FUTEX, address, FUTEX_WAKE, count, None, None, 0) == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"futex wake: {os.strerror(err)}")


_FENCE_WORD = ctypes.c_uint32(0)


def _kernel_fence() -> None:
    """A FUTEX_WAKE, which runs a full memory barrier (smp_mb) in the kernel."""
    futex_wake(ctypes.addressof(_FENCE_WORD), 1)


def _no_fence() -> None:
    """x86-64 keeps stores in order and loads in order: all the slot protocol needs."""


# Called between writing a slot's data and its sequence word, and between reading a changed
# sequence word and the data, so that weakly ordered CPUs (aarch64) see the data first.
fence = _no_fence if platform.machine() == "x86_64" else _kernel_fence


class Doorbell:
    """Word `index` of `words` (a uint32 memoryview of a mapping at `base_address`), with the
    word `sleeping_index` that its one waiter raises while in FUTEX_WAIT."""

    def __init__(self, words: memoryview, base_address: int, index: int, sleeping_index: int):
        self.words = words
        self.index = index
        self.sleeping_index = sleeping_index
        self.address = base_address + 4 * index

    def value(self) -> int:
        return self.words[self.index]

    def set(self, value: int) -> None:
        """Store `value` and wake the waiter if it sleeps."""
        self.words[self.index] = value & WORD_MASK
        if self.words[self.sleeping_index]:
            futex_wake(self.address)

    def ring(self) -> None:
        self.set(self.words[self.index] + 1)

    def wake(self) -> None:
        """Wake a sleeping waiter without changing the word (it re-checks its other conditions)."""
        futex_wake(self.address)

    def wait(self, seen: int, spin_s: float, sleep_s: float, ready: Callable[[], bool] | None = None) -> bool:
        """Wait until the word differs from `seen`: spin up to spin_s, then sleep up to sleep_s.
        True when it changed, False on timeout or an early wake (callers loop with their checks).
        While spinning, `ready()` returning True ends the wait too (work a GPU announced: it
        can change words but cannot wake a sleeper)."""
        words, index = self.words, self.index
        if words[index] != seen:
            return True
        if spin_s > 0:
            clock = time.perf_counter
            start = clock()
            end, polite = start + spin_s, start + YIELD_AFTER_S
            while (now := clock()) < end:
                if words[index] != seen or (ready is not None and ready()):
                    return True
                if now > polite:  # a machine with fewer cores than busy processes: let others run
                    os.sched_yield()
        if sleep_s <= 0:
            return words[index] != seen
        deadline = time.monotonic() + sleep_s
        words[self.sleeping_index] = 1
        try:
            first_sleep = min(sleep_s, FIRST_SLEEP_S)
            futex_wait(self.address, seen, first_sleep)
            remaining = deadline - time.monotonic()
            if words[index] == seen and remaining > 0:
                futex_wait(self.address, seen, remaining)
        finally:
            words[self.sleeping_index] = 0
        return words[index] != seen
