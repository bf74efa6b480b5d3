"""The parent's expert daemons: spawned or connected, handshaken, attached by the transport
moerun.rig.transport chooses, and assigned their experts; marked down when they fail (their
experts then run on the parent); watched and brought back. `executor()` gives the forward
pass the dispatcher for the parent's backend.

Threads (moerun.rig.links): each link has a watcher thread for heartbeats and rejoins; while
a link is down its client belongs to the watcher alone, so a restart never blocks or slows
generation.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from moerun.backends.devices import DEVICE_PATTERN, BackendUnavailable, check_device
from moerun.backends.gpu.ipc import TransportUnavailable
from moerun.backends.memory import device_memory_free
from moerun.backends.numpy_backend import CpuExperts, expert_store
from moerun.backends.protocol import Backend, Experts
from moerun.gguf.reader import GGUFFile
from moerun.ipc.client import DaemonClient
from moerun.ipc.curve import CurveClientKeys
from moerun.ipc.protocol import DaemonTimeout, DaemonUnreachable
from moerun.ipc.shm import sweep_stale_segments
from moerun.ipc.sockets import remove_socket_file
from moerun.models.spec import ModelSpec
from moerun.moe.executor import ExpertExecutor
from moerun.moe.placement import Placement, hot_placement, load_placement
from moerun.moe.planner import (
    DeviceBudget,
    PlanError,
    PlanRequest,
    explain,
    model_sizes,
    plan,
)
from moerun.rig.cores import HostShares
from moerun.rig.cpu_dispatch import CpuDispatcher
from moerun.rig.gpu.channels import GpuAttachments
from moerun.rig.gpu.dispatch import GpuDispatcher
from moerun.rig.links import DAEMON_FAILURES, DaemonLink, RigError, failure_reason
from moerun.rig.settings import AUTO, DaemonEntry, RigConfig
from moerun.rig.spawn import (
    LocalDaemon,
    make_run_dir,
    remove_run_dir,
    spawn_local_daemon,
    sweep_stale_run_dirs,
)
from moerun.rig.transport import (
    THROUGH_MAPPED_ARENA,
    Facts,
    TransportChoice,
    choose_transport,
)
from moerun.units import available_host_bytes

SPAWN_TIMEOUT_S = 60.0
GOODBYE_TIMEOUT_S = 2.0
PROGRESS_EVERY_S = 1.0
WAIT_NOTICE_S = 1.0          # a daemon not answering for this long at start is named while it is awaited
HEARTBEAT_S = 1.0            # a daemon not heard from for this long gets a PING
BACKOFF_FIRST_S = 0.5        # wait before the first try to bring a daemon back,
BACKOFF_MAX_S = 30.0         # twice as long after each failed try, up to this
ARENA_SLOTS = 4              # requests in flight per daemon through its arena

logger = logging.getLogger(__name__)


class Rig:
    def __init__(self, config: RigConfig, gguf: GGUFFile, spec: ModelSpec, backend: Backend, kv_tokens: int,
                 cpus: HostShares, layers: range | None = None):
        """backend: the parent's; a GPU parent attaches the daemons' arenas for its kernels. cpus:
        the threads (and with --pin the cores) of the parent and of each CPU daemon spawned here.
        layers: the layers whose experts this process computes (the others run on layer shards,
        or this process is one); None: all."""
        self.config = config
        self.cpus = cpus
        self.backend = backend
        self.gpu = GpuAttachments(backend) if backend.kind != "CPU" else None
        self.gguf = gguf
        self.spec = spec
        self.kv_tokens = kv_tokens
        self.layers = layers
        self.model_path = gguf.path
        self.fingerprint = gguf.fingerprint()
        self.placement = None if config.placement == AUTO else _placement(config, spec, self.fingerprint)
        self.links: list[DaemonLink] = []
        self.closing = threading.Event()
        self._watchers: list[threading.Thread] = []
        sweep_stale_segments()
        sweep_stale_run_dirs()
        self.run_dir = make_run_dir()
        self.context = zmq.Context()
        try:
            self._start(gguf)
            for link in self.links:
                watcher = threading.Thread(target=self._watch, args=(link,), name=f"moerun-watch-{link.label}",
                                           daemon=True)
                watcher.start()
                self._watchers.append(watcher)
        except BaseException:
            self.close()
            raise

    def executor(self, parent_experts: Experts, cache_bytes: int) -> ExpertExecutor:
        """The MoE step with these daemons, for the parent's backend: `parent_experts` are the
        ones it holds; a failed daemon's pairs are computed on the parent's CPU from the mmap."""
        if self.gpu is None:
            return CpuDispatcher(self, parent_experts)
        fallback = CpuExperts(expert_store(self.gguf, self.spec, cache_bytes, self.cpus.parent.threads), None)
        return GpuDispatcher(self.backend, parent_experts, self, self.gpu, fallback)

    def _start(self, gguf: GGUFFile) -> None:
        for i, spec in enumerate(self.config.daemons):
            self.links.append(self._link(i, spec))
        waited_since = time.monotonic()
        self._greet_all()
        if self.placement is None:
            self.placement = self._auto_placement(gguf)
        if self.layers is not None:                 # the other layers run in other processes
            self.placement = self.placement.within(self.layers)
        for link in self.links:
            if not self.placement.experts_of(link.index):
                why = f"--hot {self.config.hot} keeps" if self.config.hot is not None else "this placement keeps"
                logger.info(f"daemon {link.name} holds no experts ({why} them all on the parent and the other "
                            f"daemons): it stays idle")
        self._assign_all(waited_since)

    def _link(self, index: int, spec: str) -> DaemonLink:
        """Daemon `index`: spawned here (its process starts now) or at its endpoint, and its client."""
        entry = self._entry(index)
        local = self._spawn(index, spec) if DEVICE_PATTERN.match(spec) else None
        try:
            client = DaemonClient(local.endpoint if local else spec, context=self.context,
                                  connect_timeout_s=SPAWN_TIMEOUT_S if local else self.config.daemon_timeout_s,
                                  curve=self._curve_keys(index), expect_listening=local is None)
        except BaseException:
            if local:
                local.stop()
            raise
        return DaemonLink(index, spec, client, local, label=entry.name if entry else "")

    def _entry(self, index: int) -> DaemonEntry | None:
        """Daemon `index`'s [[daemon]] table of a config file; None when the daemons came
        from flags (they replace the file's tables)."""
        entries = self.config.daemon_entries
        return entries[index] if entries else None

    def _curve_keys(self, index: int) -> CurveClientKeys | None:
        """The CURVE keys for daemon `index`, when the rig names its public key."""
        public_key = self.config.curve_public_key("daemon", index)
        if public_key is None:
            return None
        return CurveClientKeys.from_files(self.config.client_secret_key, public_key)

    def _auto_placement(self, gguf: GGUFFile) -> Placement:
        """--placement auto: plan from the memory each process can have now. A GPU parent has
        its device's free memory, less its expert cache and (with CPU daemons) the prefill
        streaming's buffers; a CPU parent and the CPU daemons on this host share its available
        RAM equally; other daemons report their own free memory in HELLO."""
        local_cpu = [link for link in self.links if link.client.info.get("device") == "cpu" and link.client.same_host()]
        host_share = available_host_bytes() // (1 + len(local_cpu))
        daemons = tuple(DeviceBudget(link.spec,
                                     host_share if link in local_cpu else int(link.client.info["free_bytes"]))
                        for link in self.links)
        on_gpu = self.backend.kind != "CPU"
        parent = DeviceBudget(f"parent {self.backend.name}", device_memory_free(self.backend) if on_gpu else host_share,
                              True)
        streams = on_gpu and self.config.stream_tokens is not None and any(
            link.client.info.get("device") == "cpu" for link in self.links)
        request = PlanRequest(sizes=model_sizes(gguf, self.spec), parent=parent, daemons=daemons,
                              context=self.kv_tokens, kv_types=self.config.kv_cache_types,
                              expert_cache_bytes=self.config.expert_cache_bytes if on_gpu else 0, streams=streams)
        try:
            result = plan(request)
        except PlanError as err:
            raise RigError(f"--placement auto: {err}") from None
        logger.info(f"--placement auto:\n{explain(result)}")
        return result.placement

    def _spawn(self, index: int, spec: str) -> LocalDaemon:
        """Start daemon `index` on this host; a device it could not drive is refused here, in one
        message, rather than by the daemon's own error."""
        entry = self._entry(index)
        try:
            check_device(spec)
            return spawn_local_daemon(spec, self.model_path, self.run_dir, index, **self.cpus.spawn_settings(index),
                                      extra_args=(*(entry.node_flags if entry else ()),
                                                  *(() if self.config.graphs else ("--no-graph",))))
        except (ValueError, BackendUnavailable) as err:      # a GPU this process cannot see or drive
            raise RigError(f"--daemon {err}") from None

    def _wait_for_socket(self, local: LocalDaemon) -> None:
        """Until the spawned daemon listens: its socket file appears, or it dies, or time runs
        out, or the rig closes."""
        path = Path(local.endpoint.removeprefix("ipc://"))
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while not path.exists() and not self.closing.wait(0.02):
            if not local.alive():
                raise RigError(f"daemon {local.spec} exited while starting (status {local.process.returncode}):\n"
                               f"{local.stderr_tail()}")
            if time.monotonic() > deadline:
                raise RigError(f"daemon {local.spec} did not start listening within {SPAWN_TIMEOUT_S:.0f} s:\n"
                               f"{local.stderr_tail()}")

    def _alive(self, link: DaemonLink) -> Callable[[], bool]:
        """For the client's waits: False once the daemon's process is gone or the rig closes."""
        return lambda: link.alive() and not self.closing.is_set()

    def _greet_all(self) -> None:
        """HELLO to every daemon at once (a spawned one once it listens), saying which ones it still
        waits for, then attach each. A daemon started elsewhere that is unreachable (found at once)
        or does not answer within --daemon-timeout starts down: its experts run on the parent and its
        watcher keeps calling it, as for a daemon lost later; unless --require-daemons is set, or
        --placement auto needs its memory. Any other failure (a refusal: busy, another model, a
        CURVE key it does not take) stops the start at once."""
        failures: dict[int, Exception] = {}

        def greet(link: DaemonLink) -> None:
            try:
                if link.local:
                    self._wait_for_socket(link.local)
                self._hello(link)
            except Exception as err:  # noqa: BLE001 - judged below, on this thread
                failures[link.index] = err

        self._together([threading.Thread(target=greet, args=(link,), daemon=True) for link in self.links],
                       self._say_waiting)
        for link in self.links:
            err = failures.get(link.index)
            if err is None:
                try:
                    link.transport = self._attach(link).transport
                except Exception as attach_err:  # noqa: BLE001 - any failure to attach is a start-up failure
                    raise RigError(_startup_failure(link, attach_err)) from None
            elif self._may_start_without(link, err):
                with link.lock:
                    self.mark_down(link, failure_reason(err, self.config.daemon_timeout_s, "at start"))
            else:
                raise RigError(_startup_failure(link, err)) from None

    def _together(self, threads: list[threading.Thread], watch: Callable[[list[threading.Thread]], None]) -> None:
        """Run the start-up threads, watch(threads) until they end, then join them. Should the
        watching be interrupted (Ctrl-C), the rig closes, which ends their waits at their next
        poll, and they are joined before the interruption goes on."""
        for thread in threads:
            thread.start()
        try:
            watch(threads)
        except BaseException:
            self.closing.set()
            raise
        finally:
            for thread in threads:
                thread.join()

    def _say_waiting(self, threads: list[threading.Thread]) -> None:
        """Until every greeting ends: after WAIT_NOTICE_S, one line for each daemon still awaited."""
        started, said = time.monotonic(), set()
        while any(thread.is_alive() for thread in threads):
            if time.monotonic() - started >= WAIT_NOTICE_S:
                for link, thread in zip(self.links, threads):
                    if thread.is_alive() and link.index not in said:
                        said.add(link.index)
                        limit = SPAWN_TIMEOUT_S if link.local else self.config.daemon_timeout_s
                        logger.info(f"waiting for daemon {link.name} to answer, up to {limit:g} s")
            time.sleep(0.05)

    def _may_start_without(self, link: DaemonLink, err: Exception) -> bool:
        """A daemon started elsewhere that is unreachable or did not answer in time, when nothing
        needs it now."""
        return (link.local is None and isinstance(err, (DaemonTimeout, DaemonUnreachable))
                and not self.config.require_daemons and self.config.placement != AUTO)

    def _hello(self, link: DaemonLink) -> None:
        link.client.hello(self.fingerprint, self._alive(link), model=str(self.model_path))

    def _handshake(self, link: DaemonLink) -> None:
        self._hello(link)
        link.transport = self._attach(link).transport

    def _attach(self, link: DaemonLink) -> TransportChoice:
        """Attach the daemon by the transport chosen for it, falling back as choose_transport says."""
        facts = Facts(daemon=link.name, asked=self._asked_transport(link), same_host=link.client.same_host(),
                      parent_device=self.backend.name, daemon_device=str(link.client.info.get("device", "cpu")),
                      parent_maps_arena=self.gpu is not None and self.gpu.maps_arena)
        choice = choose_transport(facts)
        layout = dict(batch_capacity=self.config.tokens_per_call, hidden=self.spec.hidden,
                      max_pairs_per_token=self.spec.n_experts_used, slots=ARENA_SLOTS, alive=self._alive(link))
        if choice.transport == "device":
            try:
                self.gpu.attach_device(link, **layout)
                return choice
            except (TransportUnavailable, *DAEMON_FAILURES) as err:
                choice = choose_transport(facts, device_failure=str(err))
        if choice.note:
            logger.info(choice.note)
        if choice.transport == "shared" and self.gpu is not None:
            self.gpu.attach_shared(link, mapped=choice.parent_side == THROUGH_MAPPED_ARENA, **layout)
        elif choice.transport == "shared":
            link.client.attach_shared(**layout)
        return choice

    def _asked_transport(self, link: DaemonLink) -> str:
        """The transport its [[daemon]] table names, else the rig's."""
        entry = self._entry(link.index)
        return entry.transport if entry is not None and entry.transport else self.config.transport

    def _assign_all(self, waited_since: float) -> None:
        """Every daemon loads its experts at once; progress goes to stderr, and then how long the
        daemons took to be ready since the parent began waiting for them (waited_since)."""
        assignments = {link.index: self.placement.experts_of(link.index) for link in self.links if link.up}
        total = sum(len(ids) for experts in assignments.values() for ids in experts.values())
        done = dict.fromkeys(assignments, 0)
        failures: list[str] = []
        last_print = time.monotonic()
        lock = threading.Lock()

        def progress(index: int, count: int) -> None:
            nonlocal last_print
            with lock:
                done[index] = count
                if time.monotonic() - last_print > PROGRESS_EVERY_S:
                    last_print = time.monotonic()
                    logger.info(f"loading experts on daemons: {sum(done.values())}/{total}")

        def assign(link: DaemonLink) -> None:
            try:
                link.client.assign(assignments[link.index], lambda count, _total: progress(link.index, count),
                                   alive=self._alive(link))
            except Exception as err:  # noqa: BLE001 - reported with every daemon's, after the threads end
                failures.append(_startup_failure(link, err))

        self._together([threading.Thread(target=assign, args=(link,)) for link in self.links if link.up], _join)
        if failures:
            raise RigError("; ".join(failures))
        if assignments:
            logger.info(f"{len(assignments)} daemon(s) ready with {total} experts in "
                        f"{time.monotonic() - waited_since:.1f} s")

    def mark_down(self, link: DaemonLink, reason: str) -> None:
        """Stop sending work to a daemon, say so once, and rouse its watcher. The caller holds
        link.lock: no other request to the daemon is under way."""
        if not link.up:
            return
        link.up, link.down_reason, link.down_since = False, reason, time.monotonic()
        link.times_down += 1
        then = "--require-daemons is set" if self.config.require_daemons else \
            "the parent computes its experts until it rejoins"
        logger.warning(f"daemon {link.name} {reason}; {then}")
        link.wake.set()

    def check(self) -> None:
        """With --require-daemons: a RigError once any daemon is down."""
        if self.config.require_daemons:
            for link in self.links:
                if not link.up:
                    raise RigError(f"daemon {link.name} {link.down_reason} (--require-daemons is set)")

    def rejoin(self, link: DaemonLink) -> None:
        """Bring back a daemon that is down. A spawned one is killed (it may only hang) and
        started again on a new socket; a connected one gets HELLO again on the same socket,
        so a daemon that was hung still knows its owner. Then the handshake and the experts it
        had, and the link is switched back in. Runs on the link's watcher thread, which lives
        as long as the rig: PR_SET_PDEATHSIG ties a spawned daemon to the thread that started it."""
        if link.local:
            link.local.kill()
            remove_socket_file(link.local.endpoint)
            link.local = self._spawn(link.index, link.spec)
            link.restarts += 1
            self._wait_for_socket(link.local)
            link.client.reconnect()
        self._handshake(link)
        link.client.assign(self.placement.experts_of(link.index), alive=self._alive(link))
        with link.lock:
            link.up, link.down_reason = True, None
            link.session += 1
            link.rejoins += 1
        process = f" as pid {link.local.process.pid}" if link.local else ""
        logger.info(f"daemon {link.name} rejoined{process} after {time.monotonic() - link.down_since:.1f} s down; "
            f"its experts run there again")

    # -- the watchers: one thread per link -----------------------------------------------------

    def _watch(self, link: DaemonLink) -> None:
        """Heartbeats while the link is up; while it is down, tries to bring it back (not with
        --require-daemons: that run stops). Ends when the rig closes."""
        while not self.closing.is_set():
            if link.up:
                link.wake.clear()
                self._heartbeat(link)
                link.wake.wait(HEARTBEAT_S)
            elif self.config.require_daemons:
                self.closing.wait()
            else:
                self._bring_back(link)

    def _heartbeat(self, link: DaemonLink) -> None:
        """PING a daemon not heard from for HEARTBEAT_S, unless the generation thread is talking
        to it right now; mark it down when its process is gone or the PING fails."""
        if not link.lock.acquire(blocking=False):
            return
        try:
            if not link.up:
                return
            if not link.alive():
                self.mark_down(link, "died")
            elif time.monotonic() - link.client.last_heard >= HEARTBEAT_S:
                try:
                    link.client.ping(self.config.daemon_timeout_s, self._alive(link))
                except DAEMON_FAILURES as err:
                    if not self.closing.is_set():
                        self.mark_down(link, failure_reason(err, self.config.daemon_timeout_s))
        finally:
            link.lock.release()

    def _bring_back(self, link: DaemonLink) -> None:
        """Rejoin tries until one works or the rig closes: the first after BACKOFF_FIRST_S, each
        next one twice as late, at most BACKOFF_MAX_S."""
        delay = BACKOFF_FIRST_S
        while not self.closing.wait(delay):
            try:
                self.rejoin(link)
                return
            except Exception as err:  # noqa: BLE001 - whatever failed, the next try may work
                if self.closing.is_set():
                    return
                delay = min(2 * delay, BACKOFF_MAX_S)
                logger.warning(f"daemon {link.name} did not rejoin (next try in {delay:g} s): {err}")

    def close(self) -> None:
        """Stop the watchers, end the session with every connected daemon, stop the spawned
        ones (SIGTERM: a daemon a watcher started already got it from PR_SET_PDEATHSIG when
        that thread ended), remove the run directory."""
        self.closing.set()
        for link in self.links:
            link.wake.set()
        for watcher in self._watchers:
            watcher.join()
        try:
            if self.gpu is not None:
                self.gpu.release()
            for link in self.links:
                try:
                    if not link.local and link.client.info and link.up:     # handshaken and answering
                        link.client.bye(timeout_s=GOODBYE_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - it is going away either way
                    pass
                link.client.close()
                if link.local:
                    link.local.stop()
        finally:
            self.links = []
            remove_run_dir(self.run_dir)
            self.context.destroy(linger=0)   # every thread that used it has ended; nothing is left open


def _placement(config: RigConfig, spec: ModelSpec, fingerprint: str) -> Placement:
    specs = list(config.daemons)
    if config.placement:
        return load_placement(config.placement, spec, specs, fingerprint)
    hot = config.hot if config.hot is not None else min(spec.n_experts_used, spec.n_experts)
    return hot_placement(spec, hot, specs)


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join()


def _startup_failure(link: DaemonLink, err: Exception) -> str:
    """"daemon d0 tcp://box:7070: busy: serving parent pid 4242 on box-2 since …" (the client's
    own "daemon ENDPOINT: " left out of the error's text), and a spawned daemon's stderr."""
    message = f"daemon {link.name}: {str(err).removeprefix(f'daemon {link.client.endpoint}: ')}"
    if link.local:
        tail = link.local.stderr_tail()
        message += f"\n--- its stderr ---\n{tail}" if tail else ""
    return message

