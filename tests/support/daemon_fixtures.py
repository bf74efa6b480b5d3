"""Real `moerun daemon` processes for tests, listening on ipc:// sockets, and the model and
fault-free greedy tokens the fault and supervision tests compare against."""
from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from tests.support.hf_models import tiny_model
from tests.support.to_gguf import write_gguf

PROMPT = [5, 17, 33, 2, 250, 64]
N_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0)


def tiny_daemon_model(folder: Path) -> Path:
    """A tiny qwen3moe in F32."""
    return write_gguf(tiny_model("qwen3moe", seed=4), folder / "m.gguf", "F32")


def fault_free_tokens(model: Path) -> list[int]:
    """Greedy tokens for PROMPT with every expert on the parent."""
    with Runtime(model) as runtime:
        return list(runtime.generate(PROMPT, N_TOKENS, GREEDY))


@contextmanager
def running_daemons(model: Path, count: int, run_dir: Path, device: str = "cpu"):
    """Start `count` daemons for `model`; yield their endpoints; stop them all."""
    processes, endpoints = [], []
    try:
        for i in range(count):
            endpoint = f"ipc://{run_dir}/test-daemon-{i}.sock"
            log = (run_dir / f"test-daemon-{i}.log").open("wb")
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "moerun", "daemon", "-m", str(model), "--device", device, "--listen", endpoint],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log))
            endpoints.append(endpoint)
        for endpoint, process in zip(endpoints, processes):
            wait_for_socket(Path(endpoint.removeprefix("ipc://")), process)
        yield endpoints
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_for_socket(path: Path, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, f"daemon exited with {process.returncode}"
        assert time.monotonic() < deadline, "daemon did not start listening"
        time.sleep(0.02)

