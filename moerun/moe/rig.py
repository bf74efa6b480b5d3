"""The parent's expert daemons: spawned or connected, handshaken, assigned their
experts, watched, and marked down when they fail (their experts then run on the parent)."""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from threadpoolctl import ThreadpoolController

from moerun.config import AUTO, LOCAL_DEVICE, RigConfig
from moerun.daemons.launcher import (
    LocalDaemon,
    make_run_dir,
    remove_run_dir,
    spawn_local_daemon,
    sweep_stale_run_dirs,
)
from moerun.gguf.reader import GGUFFile
from moerun.ipc.client import DaemonClient
from moerun.ipc.shm import sweep_stale_segments
from moerun.models.spec import ModelSpec
from moerun.moe.placement import Placement, hot_placement, load_placement
from moerun.moe.planner import (
    DeviceBudget,
    PlanError,
    PlanRequest,
    explain,
    model_sizes,
    plan,
)
from moerun.units import available_host_bytes

SPAWN_TIMEOUT_S = 60.0
GOODBYE_TIMEOUT_S = 2.0
PROGRESS_EVERY_S = 1.0


class RigError(RuntimeError):
    """The rig cannot run as asked (a daemon failed to start, a required daemon failed)."""


def log(message: str) -> None:
    print(f"moerun: {message}", file=sys.stderr, flush=True)


@dataclass
class DaemonLink:
    index: int
    spec: str
    client: DaemonClient
    local: LocalDaemon | None
    down_reason: str | None = None
    fallback_calls: int = 0                 # requests the parent computed itself instead

    @property
    def name(self) -> str:
        return f"d{self.index} {self.spec}"

    @property
    def up(self) -> bool:
        return self.down_reason is None

    def alive(self) -> bool:
        return self.local.alive() if self.local else True


class Rig:
    def __init__(self, config: RigConfig, gguf: GGUFFile, spec: ModelSpec, kv_tokens: int):
        self.config = config
        self.spec = spec
        self.kv_tokens = kv_tokens
        self.fingerprint = gguf.fingerprint()
        self.placement = None if config.placement == AUTO else _placement(config, spec, self.fingerprint)
        self.links: list[DaemonLink] = []
        self._blas_limit = None
        self.context = zmq.Context()
        sweep_stale_segments()
        sweep_stale_run_dirs()
        self.run_dir = make_run_dir()
        try:
            self._start(gguf)
        except BaseException:
            self.close()
            raise

    def _start(self, gguf: GGUFFile) -> None:
        cpu_daemons = sum(spec == "cpu" for spec in self.config.daemons)
        cpu_threads = max(1, (os.cpu_count() or 1) // (cpu_daemons + 1))
        if cpu_daemons:   # the parent's BLAS threads spin while it waits: share the cores, don't fight
            self._blas_limit = ThreadpoolController().limit(limits=cpu_threads, user_api="blas")
        locals_ = {i: spawn_local_daemon(spec, gguf.path, self.run_dir, i, cpu_threads)
                   for i, spec in enumerate(self.config.daemons) if LOCAL_DEVICE.match(spec)}
        for i, spec in enumerate(self.config.daemons):
            local = locals_.get(i)
            endpoint = local.endpoint if local else spec
            if local:
                _wait_for_socket(local)
            connect_timeout = SPAWN_TIMEOUT_S if local else self.config.daemon_timeout_s
            client = DaemonClient(endpoint, context=self.context, connect_timeout_s=connect_timeout)
            link = DaemonLink(i, spec, client, local)
            self.links.append(link)
            self._handshake(link)
        if self.placement is None:
            self.placement = self._auto_placement(gguf)
        self._assign_all()

    def _auto_placement(self, gguf: GGUFFile) -> Placement:
        """--placement auto: plan from the memory each process can have now. The parent and
        the CPU daemons on this host share its available RAM equally; other daemons report
        their own free memory in HELLO."""
        local_cpu = [link for link in self.links if link.client.info.get("device") == "cpu" and link.client.same_host()]
        host_share = available_host_bytes() // (1 + len(local_cpu))
        daemons = tuple(DeviceBudget(link.spec, host_share if link in local_cpu else int(link.client.info["free_bytes"]))
                        for link in self.links)
        request = PlanRequest(sizes=model_sizes(gguf, self.spec), parent=DeviceBudget("parent cpu", host_share, True),
                              daemons=daemons, context=self.kv_tokens, kv_dtype="f32")
        try:
            result = plan(request)
        except PlanError as err:
            raise RigError(f"--placement auto: {err}") from None
        log(f"--placement auto:\n{explain(result)}")
        return result.placement

    def _handshake(self, link: DaemonLink) -> None:
        try:
            link.client.hello(self.fingerprint)
        except Exception as err:
            raise RigError(_startup_failure(link, err)) from None
        transport = self.config.transport
        if transport == "auto":
            transport = "shared" if link.client.same_host() else "stream"
        if transport == "shared":
            if not link.client.same_host():
                raise RigError(f"daemon {link.name} runs on another host: --transport shared needs it on this one")
            link.client.attach_shared(batch_capacity=self.config.tokens_per_call, hidden=self.spec.hidden,
                                      max_pairs_per_token=self.spec.n_experts_used)

    def _assign_all(self) -> None:
        """Every daemon loads its experts at once; progress goes to stderr."""
        assignments = {link.index: self.placement.experts_of(link.index) for link in self.links}
        total = sum(len(ids) for experts in assignments.values() for ids in experts.values())
        done = dict.fromkeys(assignments, 0)
        failures: list[str] = []
        started = last_print = time.monotonic()
        lock = threading.Lock()

        def progress(index: int, count: int) -> None:
            nonlocal last_print
            with lock:
                done[index] = count
                if time.monotonic() - last_print > PROGRESS_EVERY_S:
                    last_print = time.monotonic()
                    log(f"loading experts on daemons: {sum(done.values())}/{total}")

        def assign(link: DaemonLink) -> None:
            try:
                link.client.assign(assignments[link.index], lambda count, _total: progress(link.index, count))
            except Exception as err:
                failures.append(_startup_failure(link, err))

        threads = [threading.Thread(target=assign, args=(link,)) for link in self.links]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise RigError("; ".join(failures))
        log(f"{len(self.links)} daemon(s) ready with {total} experts in {time.monotonic() - started:.1f} s")

    def mark_down(self, link: DaemonLink, reason: str) -> None:
        """Stop using a daemon; say so once. With --require-daemons, stop the run instead."""
        if self.config.require_daemons:
            raise RigError(f"daemon {link.name} {reason} (--require-daemons is set)")
        if link.up:
            link.down_reason = reason
            log(f"daemon {link.name} {reason}; the parent computes its experts from now on")
            if link.local:
                link.local.kill()          # hung or broken: it must not hold memory or answer late

    def close(self) -> None:
        """Say goodbye to every daemon, stop the spawned ones, remove the run directory."""
        for link in self.links:
            try:
                if link.client.info and link.up and link.alive():     # handshaken and answering
                    if link.local:
                        link.client.shutdown(timeout_s=GOODBYE_TIMEOUT_S)
                    else:
                        link.client.bye(timeout_s=GOODBYE_TIMEOUT_S)
            except Exception:
                pass  # it is going away either way
            link.client.close()
            if link.local:
                link.local.stop()
        self.links = []
        remove_run_dir(self.run_dir)
        self.context.term()
        if self._blas_limit is not None:
            self._blas_limit.restore_original_limits()


def _placement(config: RigConfig, spec: ModelSpec, fingerprint: str) -> Placement:
    specs = list(config.daemons)
    if config.placement:
        return load_placement(config.placement, spec, specs, fingerprint)
    hot = config.hot if config.hot is not None else min(spec.n_experts_used, spec.n_experts)
    return hot_placement(spec, hot, specs)


def _wait_for_socket(local: LocalDaemon) -> None:
    """Until the spawned daemon listens: its socket file appears, or it dies, or time runs out."""
    path = Path(local.endpoint.removeprefix("ipc://"))
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not path.exists():
        if not local.alive():
            raise RigError(f"daemon {local.spec} exited while starting (status {local.process.returncode}):\n"
                           f"{local.stderr_tail()}")
        if time.monotonic() > deadline:
            raise RigError(f"daemon {local.spec} did not start listening within {SPAWN_TIMEOUT_S:.0f} s:\n"
                           f"{local.stderr_tail()}")
        time.sleep(0.02)


def _startup_failure(link: DaemonLink, err: Exception) -> str:
    message = f"daemon {link.name} ({link.client.endpoint}): {err}"
    if link.local:
        tail = link.local.stderr_tail()
        message += f"\n--- its stderr ---\n{tail}" if tail else ""
    return message

