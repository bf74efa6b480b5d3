"""Round trip of a GPU parent's decode-sized request (one token, ids and weights [1, K] with
half of the slots -1) to a real CPU daemon over shared memory, posted and collected from the
host: on a tiny model (kernel work of a few µs) it is the cost of a call outside the kernels.

    python scripts/bench_daemon_call.py MODEL.gguf [--calls 3000]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moerun.gguf.reader import GGUFFile
from moerun.ipc.client import DaemonClient
from moerun.models import load_spec

SLOTS_PER_TOKEN = 8


def timed_calls(model: str, spec, fingerprint: str, socket: Path, calls: int) -> list[float]:
    """Seconds of each round trip (500 untimed first) to a daemon started here, stopped after."""
    layer = spec.moe_layers.index(True)
    daemon = subprocess.Popen([sys.executable, "-m", "moerun", "daemon", "-m", model, "--device", "cpu",
                               "--listen", f"ipc://{socket}", "--threads", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not socket.exists():
            if daemon.poll() is not None:
                raise SystemExit("the daemon stopped before it listened")
            time.sleep(0.05)
        with DaemonClient(f"ipc://{socket}", connect_timeout_s=30) as client:
            client.hello(fingerprint)
            client.assign({layer: list(range(spec.n_experts // 2, spec.n_experts))})
            client.attach_shared(batch_capacity=4, hidden=spec.hidden, max_pairs_per_token=SLOTS_PER_TOKEN)
            frames = client.arena.slots[0]
            ids = np.full(SLOTS_PER_TOKEN, -1, np.int32)
            ids[:SLOTS_PER_TOKEN // 2] = np.arange(SLOTS_PER_TOKEN // 2) % (spec.n_experts // 2)
            frames._x["f32"][:1] = np.random.default_rng(0).standard_normal((1, spec.hidden))
            frames._local_ids[:SLOTS_PER_TOKEN] = ids
            frames._weights[:SLOTS_PER_TOKEN] = 1 / SLOTS_PER_TOKEN
            times = []
            for _ in range(500 + calls):
                started = time.perf_counter()
                client.collect(client.post(0, layer, "f32", 1), timeout_s=10)
                times.append(time.perf_counter() - started)
            client.bye()
    finally:
        daemon.terminate()
        daemon.wait()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--calls", type=int, default=3000, help="timed calls, after 500 more [default: 3000]")
    args = parser.parse_args()
    with GGUFFile(args.model) as gguf:
        spec, fingerprint = load_spec(gguf), gguf.fingerprint()
    with tempfile.TemporaryDirectory() as folder:
        times = timed_calls(args.model, spec, fingerprint, Path(folder) / "daemon.sock", args.calls)
    us = np.array(times[500:]) * 1e6
    print(f"{args.calls} calls: median {np.median(us):.1f} µs, p10 {np.percentile(us, 10):.1f}, "
          f"p90 {np.percentile(us, 90):.1f}")


if __name__ == "__main__":
    main()
