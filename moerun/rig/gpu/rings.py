"""Daemon requests rung from the device inside a captured decode step.

A daemon on this host behind the pinned arena (transport "shared", the arena mapped here)
needs no host action per layer in a captured step: pack_remote writes the request into its
slot, ring_slot the header and the slot's request sequence word (which the daemon spins on),
the parent's hot experts run, await_slot spins on the reply's sequence word, and
add_reply_rows adds the reply in. The host only opens the step (a sleeping daemon is woken:
the device cannot) and watches it finish (rousing a daemon that fell asleep between layers):
a daemon that died has its waits aborted, one that failed a request (an error reply, or none
within --daemon-timeout: that wait aborts the step's later ones) is marked down, and the step
runs again eagerly without it (StepRetry).

Per daemon the kernels count, in a pinned array the host reads after each step: request ids
rung, failures, nanoseconds the parent's stream waited, and the daemon's compute time.
Shape legend: T tokens, H hidden, K experts per token.
"""
from __future__ import annotations

import os
import time

import numpy as np

from moerun.backends.gpu import DAEMON_WORDS, StepRetry
from moerun.ipc import protocol as p
from moerun.ipc import shm
from moerun.ipc.protocol import ProtocolError
from moerun.rig.gpu.channels import ArenaChannel, RemoteCall

IDS, FAILURES, WAIT_NS, COMPUTE_NS = range(DAEMON_WORDS)
LIVENESS_EVERY_S = 0.001       # how often a finishing step looks at the daemons' processes


class DeviceRings:
    def __init__(self, backend, rig):
        self.backend, self.rig = backend, rig
        self.timeout_ns = int(rig.config.daemon_timeout_s * 1e9)
        cupy, n_words = backend.device.cupy, 1 + DAEMON_WORDS * len(rig.links)              # [0] abort
        runtime = cupy.cuda.runtime
        self._memory = cupy.cuda.PinnedMemory(8 * n_words, runtime.hostAllocMapped | runtime.hostAllocPortable)
        self.words = np.frombuffer(cupy.cuda.PinnedMemoryPointer(self._memory, 0), np.uint64, n_words)
        self.words[:] = 0
        self.address = np.uint64(self._memory.ptr)     # the kernels' too (only used where kernels map host memory)
        self._folded = self.words.copy()              # the counts already added to the links' counters
        self._finished = cupy.cuda.Event(block=False, disable_timing=True)

    @staticmethod
    def serves(channel) -> bool:
        """Whether a captured step rings this channel's daemon from the device."""
        return isinstance(channel, ArenaChannel) and not channel.device

    def ring(self, call: RemoteCall) -> None:
        """After the pack kernel: the request's header and sequence word, from the device."""
        spec = self.backend.spec
        self.backend.device.launch("ring_slot", (1,), (1,), (
            np.uint64(call.channel.arena.slots[call.slot].address), self.address, np.int32(call.link.index),
            np.int32(p.PROTOCOL_VERSION), np.int32(call.layer), np.int32(call.channel.payload_code),
            np.int32(call.tokens), np.int32(spec.n_experts_used), np.int32(spec.hidden)))
        call.on_device = True

    def await_reply(self, call: RemoteCall) -> None:
        """Before the reply is added: the parent's stream waits for it."""
        self.backend.device.launch("await_slot", (1,), (1,), (
            np.uint64(call.channel.arena.slots[call.slot].address), self.address, np.int32(call.link.index),
            np.uint64(self.timeout_ns)))

    # -- the host around a captured step ----------------------------------------------------

    def open(self) -> None:
        """Before a captured step is launched: every such daemon awake and spinning."""
        self.words[0] = 0
        for link in self.rig.links:
            arena = link.client.arena
            if link.up and arena is not None and link.transport == "shared":
                arena.doorbell.ring()

    def settle(self) -> None:
        """After the step's last launch: wait for it while watching the daemons' processes (a
        dead one aborts the device's waits), add its counts to the links' counters, and
        raise StepRetry when a daemon failed (now marked down)."""
        self._finished.record(self.backend.device.stream)
        dead: set[int] = set()
        next_look = 0.0
        while not self._finished.done:
            now = time.monotonic()
            if now >= next_look:
                for link in self.rig.links:
                    if link.up and not link.alive():
                        dead.add(link.index)
                    elif link.up and link.transport == "shared" and link.client.arena is not None:
                        link.client.arena.rouse()        # fell asleep between two layers' requests
                if dead:
                    self.words[0] = 1
                next_look = now + LIVENESS_EVERY_S
            os.sched_yield()
        failed = self._fold()
        if dead or failed:
            self._fail(dead, failed)

    def _fold(self) -> set[int]:
        """The step's counts into each link's counters; the links with failures."""
        spec, words = self.backend.spec, self.words
        payload_bytes = p.WIRE_ITEMSIZE[self.rig.config.expert_payload_dtype]      # a captured step: one token a call
        failed = set()
        for link in self.rig.links:
            base = 1 + DAEMON_WORDS * link.index
            delta = [int(words[base + i]) - int(self._folded[base + i]) for i in range(DAEMON_WORDS)]
            if not delta[IDS]:
                continue
            counters = link.client.counters
            counters.calls += delta[IDS]
            counters.bytes_sent += delta[IDS] * (shm.REQUEST.size + spec.hidden * payload_bytes
                                                 + 8 * spec.n_experts_used)
            counters.bytes_received += delta[IDS] * (shm.REPLY.size + 4 * spec.hidden)
            counters.wait_seconds += delta[WAIT_NS] / 1e9
            counters.compute_seconds += delta[COMPUTE_NS] / 1e9
            link.client.last_heard = time.monotonic()
            if delta[FAILURES]:
                failed.add(link.index)
        self._folded[:] = words
        return failed

    def _fail(self, dead: set[int], failed: set[int]) -> None:
        """Mark down the daemons that died or failed a request; an abort ended the waits of the
        others, whose slots must be answered before the step runs again."""
        for link in self.rig.links:
            if link.index in dead:
                reason = "died"
            elif link.index in failed:
                reason = self._failure_reason(link)
            else:
                reason = None if self._answered(link) else \
                    f"did not answer within {self.rig.config.daemon_timeout_s:g} s"
            if reason is not None:
                with link.lock:
                    self.rig.mark_down(link, reason)
        raise StepRetry()

    def _failure_reason(self, link) -> str:
        """The daemon's error reply, if one of its slots holds one; else a timeout."""
        for slot in link.client.arena.slots:
            try:
                error = shm.read_reply_header(slot.buffer)[4]
            except ProtocolError as err:
                return f"failed: unreadable slot reply ({err})"
            if error is not None:
                return f"failed: {error[0]}: {error[1]}"
        return f"did not answer within {self.rig.config.daemon_timeout_s:g} s"

    def _answered(self, link) -> bool:
        """Wait, up to the daemon timeout, until the daemon answered every slot."""
        arena = link.client.arena
        if not link.up or arena is None:
            return True
        deadline = time.monotonic() + self.rig.config.daemon_timeout_s
        while arena.any_pending():
            if time.monotonic() >= deadline or not link.alive():
                return False
            time.sleep(0.0001)
        return True
