"""Spawning local expert daemons as child processes that never outlive the parent."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from moerun.procs import pid_alive

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 5.0
RUN_DIR_PREFIX = "moerun-run-"
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass
class LocalDaemon:
    spec: str                    # cpu | cuda:N | hip:N as the user wrote it
    endpoint: str                # ipc://… socket in the parent's run directory
    process: subprocess.Popen
    log_path: Path               # the daemon's stderr

    def alive(self) -> bool:
        return self.process.poll() is None

    def stderr_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
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


def sweep_stale_run_dirs() -> None:
    """Remove run directories left by parents that were killed (their pid is gone)."""
    for path in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        pid = path.name[len(RUN_DIR_PREFIX):].split("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def spawn_local_daemon(spec: str, model_path: str | Path, run_dir: Path, index: int,
                       cpu_threads: int) -> LocalDaemon:
    """Start `moerun daemon` on `spec`'s device, seeing only that device; a CPU daemon's
    BLAS gets `cpu_threads` threads unless the environment already says how many."""
    endpoint = f"ipc://{run_dir}/daemon-{index}.sock"
    device, env = _pinned_device(spec)
    if device == "cpu":
        for variable in BLAS_THREAD_VARIABLES:
            env.setdefault(variable, str(cpu_threads))
    log_path = run_dir / f"daemon-{index}.log"
    command = [sys.executable, "-m", "moerun", "daemon", "--model", str(model_path), "--device", device,
               "--listen", endpoint, "--parent-pid", str(os.getpid())]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                   preexec_fn=_die_with_parent)
    return LocalDaemon(spec, endpoint, process, log_path)


def _pinned_device(spec: str) -> tuple[str, dict[str, str]]:
    """The device as the child sees it, and an environment that hides every other GPU."""
    env = dict(os.environ)
    kind, _, number = spec.partition(":")
    if kind == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = number
    elif kind == "hip":
        env["HIP_VISIBLE_DEVICES"] = env["ROCR_VISIBLE_DEVICES"] = number
    return (f"{kind}:0" if number else kind), env


def _die_with_parent() -> None:
    """In the child before exec: its own process group (a Ctrl-C at the terminal reaches
    only the parent, which then stops its daemons in order), and SIGTERM when the parent
    dies (Linux)."""
    os.setpgrp()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the daemon's --parent-pid watchdog still applies
