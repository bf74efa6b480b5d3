"""Spawning expert daemons (`moerun daemon` on a device) as child processes that never outlive
the parent: the parent's own, and the ones `moerun launch` starts; and their run directories."""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from moerun.errors import UsageError
from moerun.ipc.processes import pid_alive

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 5.0
RUN_DIR_PREFIX = "moerun-run-"
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass
class LocalDaemon:
    spec: str                    # cpu | cuda:N | hip:N as the user wrote it
    endpoint: str                # where it listens: ipc://… in the parent's run directory, or as configured
    process: subprocess.Popen
    log_path: Path               # the daemon's stderr, after what its predecessors wrote there
    log_start: int = 0           # where this process's output starts in it

    def alive(self) -> bool:
        return self.process.poll() is None

    def stderr_tail(self, lines: int = 15) -> str:
        """The last lines this process wrote to its stderr."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self.log_start)
                return "\n".join(log.read().decode(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (and SIGCONT, should it be stopped), then SIGKILL after a grace period;
        always reaps the process."""
        if self.alive():
            self.process.terminate()
            self.process.send_signal(signal.SIGCONT)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def make_run_dir() -> Path:
    """A private (0700) directory for this parent's daemon sockets and logs."""
    return Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-"))


def remove_run_dir(run_dir: Path) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)


def remove_orphaned_run_dir(listen: str, parent_pid: int) -> None:
    """For a spawned daemon as it exits: when the parent whose run directory holds its socket is
    gone (killed, so it could not clean up), remove that directory."""
    folder = Path(listen.removeprefix("ipc://")).parent
    if folder.name.startswith(f"{RUN_DIR_PREFIX}{parent_pid}-") and not pid_alive(parent_pid):
        shutil.rmtree(folder, ignore_errors=True)


def sweep_stale_run_dirs() -> None:
    """Remove run directories left by parents that were killed (their pid is gone)."""
    for path in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        pid = path.name[len(RUN_DIR_PREFIX):].split("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def spawn_local_daemon(spec: str, model_path: str | Path, run_dir: Path, index: int, threads: int | None = None,
                       cpus: tuple[int, ...] | None = None, extra_args: tuple[str, ...] = ()) -> LocalDaemon:
    """Start `moerun daemon` on `spec`'s device on a socket in `run_dir`; see spawn_daemon."""
    return spawn_daemon(spec, model_path, f"ipc://{run_dir}/daemon-{index}.sock", run_dir / f"daemon-{index}.log",
                        threads, cpus, extra_args)


def spawn_daemon(spec: str, model_path: str | Path, listen: str, log_path: Path, threads: int | None = None,
                 cpus: tuple[int, ...] | None = None, extra_args: tuple[str, ...] = ()) -> LocalDaemon:
    """Start `moerun daemon` on `spec`'s device, listening on `listen`, seeing only that device,
    its output in `log_path`, with `extra_args` added to its command line. A CPU daemon runs
    `threads` threads (its BLAS too, unless the environment already says how many); `cpus`
    pins it to those CPUs before it starts (Linux)."""
    device, pinning = pinned_device(spec)
    env = {**os.environ, **pinning}
    if device == "cpu" and threads is not None:
        extra_args = ("--threads", str(threads), *extra_args)
        for variable in BLAS_THREAD_VARIABLES:
            env.setdefault(variable, str(threads))
    # -P: the installed moerun, never a source tree that happens to be the working directory
    command = [sys.executable, "-P", "-m", "moerun", "daemon", "--model", str(model_path), "--device", device,
               "--listen", listen, "--parent-pid", str(os.getpid()), *extra_args]
    with log_path.open("ab") as log:     # a restarted daemon adds to its predecessor's log
        log_start = log.tell()
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                   preexec_fn=functools.partial(_start_child, cpus))
    return LocalDaemon(spec, listen, process, log_path, log_start)


def pinned_device(spec: str, environment: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """The device as a process pinned to `spec` sees it, and the environment variables that
    hide every other GPU from it. cuda:N means the Nth GPU this process sees: when
    `environment` (this process's by default) already narrows the visible GPUs, the child
    gets the Nth of those."""
    environment = os.environ if environment is None else environment
    kind, _, number = spec.partition(":")
    names = {"cuda": ("CUDA_VISIBLE_DEVICES",), "hip": ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")}.get(kind, ())
    variables = {}
    for name in names:
        visible = [entry.strip() for entry in environment.get(name, "").split(",") if entry.strip()]
        if name in environment and int(number) >= len(visible):
            raise UsageError(f"{spec}: {name}={environment[name]!r} leaves only {len(visible)} GPU(s) visible")
        variables[name] = visible[int(number)] if name in environment else number
    return (f"{kind}:0" if number else kind), variables


def _start_child(cpus: tuple[int, ...] | None) -> None:
    """In the child before exec: its own process group (a Ctrl-C at the terminal reaches
    only the parent, which then stops its daemons in order), SIGTERM when the parent dies
    (Linux), and its CPUs, when it is pinned (every thread it starts inherits them)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    os.setpgrp()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the daemon's --parent-pid watchdog still applies
