"""A stand-in expert daemon for the IPC tests, and helpers to run it in a child process.

Run as a script it serves moerun.ipc.server.Server with FakeHandler, whose answer is easy to
check: out[t] = x[t] * (layer + 1) * Σ_k w[t,k] * (local_id[t,k] + 1).
Shape legend: T tokens, H hidden size, P routed pairs.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HIDDEN = 64
N_LAYERS = 4
N_EXPERTS = 16
FINGERPRINT = "fake-model-0123"
REPO_ROOT = Path(__file__).resolve().parents[2]
SHM_DIR = Path("/dev/shm")


def expected_output(layer: int, x: np.ndarray, counts: np.ndarray, local_ids: np.ndarray,
                    weights: np.ndarray) -> np.ndarray:
    """FakeHandler's answer for x f32 [T, H], counts [T], local_ids [P], weights [P]."""
    token_of_pair = np.repeat(np.arange(len(counts)), counts)
    scale = np.bincount(token_of_pair, weights=weights.astype(np.float64) * (local_ids + 1),
                        minlength=len(counts))
    return x * (scale * (layer + 1)).astype(np.float32)[:, None]


class FakeHandler:
    def __init__(self, fingerprint: str, sleep_s: float):
        self.fingerprint, self.sleep_s = fingerprint, sleep_s
        self.local_experts: dict[int, int] = {}   # layer -> number of local experts
        self.computes = 0

    def info(self) -> dict:
        return {"fingerprint": self.fingerprint, "device": "cpu", "backend": "numpy",
                "model": "fake", "n_layers": N_LAYERS, "n_experts": N_EXPERTS, "hidden": HIDDEN}

    def assign(self, experts, progress) -> None:
        for done, layer in enumerate(sorted(experts), start=1):
            progress(done, len(experts))
        self.local_experts = {layer: len(ids) for layer, ids in experts.items()}

    def compute(self, layer, x, counts, local_ids, weights) -> np.ndarray:
        n_local = self.local_experts[layer]
        if local_ids.size and (local_ids.min() < 0 or local_ids.max() >= n_local):
            raise IndexError(f"local expert id out of [0, {n_local}) in layer {layer}")
        if self.sleep_s:
            time.sleep(self.sleep_s)
        self.computes += 1
        return expected_output(layer, x, counts, local_ids, weights)

    def attach(self, arena, transport, header):
        if transport == "device":
            raise ValueError("the device transport needs a GPU daemon")
        return {}, None, None

    def release(self) -> None:
        self.local_experts = {}

    def stats(self) -> dict:
        return {"computes": self.computes, "layers": len(self.local_experts)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("--fingerprint", default=FINGERPRINT)
    parser.add_argument("--sleep-s", type=float, default=0.0)
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--protocol-version", type=int)
    args = parser.parse_args()
    from moerun.ipc import protocol
    from moerun.ipc.server import Server
    if args.protocol_version is not None:
        protocol.PROTOCOL_VERSION = args.protocol_version
    server = Server(args.endpoint, FakeHandler(args.fingerprint, args.sleep_s),
                    batch_capacity_max=args.capacity, lease_s=args.lease_s)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    server.serve_forever()


class DaemonProcess:
    """A fake daemon child process; its stderr goes to a file the test can read."""

    def __init__(self, endpoint: str, log_path: Path, *args: str):
        self.endpoint, self.log_path = endpoint, log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, __file__, endpoint, *args], stdout=subprocess.DEVNULL,
            stderr=self._log, cwd=REPO_ROOT)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for_log(self, text: str, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not in the daemon log:\n{self.log()}")
            time.sleep(0.01)
        return self.log()

    def stop(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait(5)
        self._log.close()


@contextlib.contextmanager
def daemon_process(*args: str, endpoint: str | None = None):
    """A running fake daemon (extra args go to its command line); stopped and reaped on exit."""
    folder = Path(tempfile.mkdtemp(prefix="moerun-ipc-"))
    daemon = DaemonProcess(endpoint or f"ipc://{folder}/daemon.sock", folder / "daemon.log", *args)
    try:
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)



def ramp(tokens: int, hidden: int = HIDDEN, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, hidden)).astype(np.float32)


def routing(tokens: int, n_local: int, max_k: int, seed: int = 0):
    """Ragged routing: counts [T] in 0..max_k (some zero), local_ids [P], weights [P]."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, max_k + 1, size=tokens).astype(np.int32)
    local_ids = np.concatenate([rng.choice(n_local, size=c, replace=False) for c in counts]
                               + [np.zeros(0, int)]).astype(np.int32)
    weights = rng.random(len(local_ids)).astype(np.float32)
    return counts, local_ids, weights


if __name__ == "__main__":
    main()
