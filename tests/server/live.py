"""A `moerun serve` process for the live tests, and reading its /metrics and memory."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

SERVE = ["-P", "-m", "moerun", "serve"]     # -P: moerun as installed, not the current directory
TIMEOUT_S = 60
ANNOUNCED = re.compile(r"moerun: serving (?P<model>\S+) at (?P<url>http://\S+) \(OpenAI API at /v1\)\n")


@contextmanager
def live_server(log_path: Path, *args):
    """A `moerun serve` process on a port the system picks (--port 0); yields (url, process) once it
    has said where it serves, which it says when the model is loaded; stops it with SIGINT."""
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, *SERVE, "--port", "0", *map(str, args)],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        yield announced_url(process, log_path), process
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def announced_url(process: subprocess.Popen, log_path: Path) -> str:
    """The URL of the server's `serving MODEL at URL (OpenAI API at /v1)` line, waited for at most TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (line := ANNOUNCED.search(log_path.read_text())):
        assert process.poll() is None, f"the server exited:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"the server did not come up:\n{log_path.read_text()}"
        time.sleep(0.1)
    return line["url"]


def scrape(url: str) -> dict:
    """Every sample on /metrics: {(name, ((label, value), ...)): value}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def peak_memory_bytes(pid: int) -> int:
    """The most memory the process has held at once (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no VmHWM")
