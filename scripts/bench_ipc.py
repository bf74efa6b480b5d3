"""Round-trip time and throughput of the daemon IPC, next to floors measured in the same run.

    python scripts/bench_ipc.py [--rounds 10] [--decode-iters 300] [--batch-iters 10]

Rows: a decode-sized request (T=1, H=2048 f32, K=8 pairs) and a 1024-token batch, through
Server/DaemonClient with a handler that returns x, for the shared and stream transports;
floors: a raw spin-flag shared-memory round trip between two processes (pure Python, the same
bytes copied in and out) and a raw pyzmq DEALER/ROUTER round trip with the same frames.
Every path keeps its child process for the whole run and the paths take turns, round after
round, so that a noisy machine slows them alike. Shape legend: T tokens, H hidden size,
K experts per token, P pairs.
"""
from __future__ import annotations

import argparse
import logging
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import zmq

HIDDEN = 2048
K = 8
BATCH_TOKENS = 1024
STOP = 0xFFFFFFFF


# -- children ------------------------------------------------------------------------------

class EchoHandler:
    """A near-free handler: out = x."""

    def info(self) -> dict:
        return {"fingerprint": "bench", "device": "cpu", "backend": "none", "model": "echo",
                "n_layers": 1, "n_experts": K, "hidden": HIDDEN}

    def assign(self, experts, progress) -> None:
        pass

    def compute(self, layer, x, counts, local_ids, weights) -> np.ndarray:
        return x

    def release(self) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def attach(self, arena, transport: str, header: dict) -> tuple[dict, None, None]:
        return {}, None, None     # padded requests come to compute() as ragged ones


def serve_moerun(endpoint: str) -> None:
    from moerun.ipc.server import Server
    logging.getLogger("moerun").setLevel(logging.WARNING)     # no session lines in the timings
    Server(endpoint, EchoHandler()).serve_forever()


def serve_raw_zmq(endpoint: str) -> None:
    """Echo x back: [peer, x, counts, ids, weights] -> [peer, x]; [peer, b"stop"] ends."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(endpoint)
    while True:
        parts = router.recv_multipart(copy=False)
        if len(parts) == 2:
            break
        router.send_multipart(parts[:2], copy=False)
    router.close(linger=0)
    context.term()


def serve_raw_shm(path: str) -> None:
    """Spin on the request word, copy x into the reply area, bump the reply word. Between
    rounds (word 4 down) it naps, so that it does not take a core from the other paths."""
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    words, buffer = memoryview(mm).cast("I"), memoryview(mm)
    reply_at, reply_bytes = words[2], words[3]
    words[5] = 1  # mapped: the parent may unlink the file
    seen = 0
    while True:
        while words[0] == seen:
            if not words[4]:
                time.sleep(0.01)
        seen = words[0]
        if seen == STOP:
            return
        buffer[reply_at:reply_at + reply_bytes] = buffer[64:64 + reply_bytes]
        words[1] = seen


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--child", *args])


# -- paths: each returns (one round trip, start of a round, end of a round, close) -----------

def request_arrays(tokens: int):
    """x f32 [T, H], counts [T] (all K), local_ids [P], weights [P]."""
    x = np.random.default_rng(0).standard_normal((tokens, HIDDEN)).astype(np.float32)
    counts = np.full(tokens, K, np.int32)
    local_ids = np.tile(np.arange(K, dtype=np.int32), tokens)
    weights = np.full(tokens * K, 1.0 / K, np.float32)
    return x, counts, local_ids, weights


def raw_shm_path(tokens: int):
    x, counts, local_ids, weights = request_arrays(tokens)
    request = np.concatenate([a.view(np.uint8).ravel() for a in (x, counts, local_ids, weights)])
    reply_at = 64 + (request.nbytes + 63) // 64 * 64
    path = os.path.join("/dev/shm", f"moerun_bench-{os.getpid()}-{tokens}")
    with open(path, "w+b") as f:
        f.truncate(reply_at + x.nbytes)
        mm = mmap.mmap(f.fileno(), 0)
    words, buffer = memoryview(mm).cast("I"), memoryview(mm)
    words[2], words[3] = reply_at, x.nbytes
    child = spawn("raw-shm", path)
    deadline = time.monotonic() + 60
    while not words[5]:
        if child.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the raw shared-memory child did not start")
        time.sleep(0.01)
    os.unlink(path)

    def round_trip():
        buffer[64:64 + request.nbytes] = request
        target = (words[0] + 1) & 0xFFFFFFFF
        words[0] = target
        while words[1] != target:
            pass
        return np.frombuffer(buffer[reply_at:reply_at + x.nbytes], np.float32).copy()

    def set_active(active: bool):
        words[4] = active

    def close():
        words[0] = STOP
        child.wait(5)
    return round_trip, lambda: set_active(True), lambda: set_active(False), close


def raw_zmq_path(endpoint: str, tokens: int):
    x, counts, local_ids, weights = request_arrays(tokens)
    child = spawn("raw-zmq", endpoint)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)

    def round_trip():
        dealer.send_multipart([x, counts, local_ids, weights], copy=False)
        return np.frombuffer(dealer.recv_multipart(copy=False)[0], np.float32)

    def close():
        dealer.send(b"stop")
        child.wait(5)
        dealer.close(linger=0)
        context.term()
    return round_trip, None, None, close


def moerun_path(endpoint: str, transport: str, tokens: int, in_flight: int = 1):
    from moerun.ipc.client import DaemonClient
    x, counts, local_ids, weights = request_arrays(tokens)
    child = spawn("moerun", endpoint)
    client = DaemonClient(endpoint)
    client.hello("bench")
    client.assign({0: list(range(K))})
    if transport == "shared":
        client.attach_shared(batch_capacity=tokens, hidden=HIDDEN, max_pairs_per_token=K)

    def round_trip():
        ids = [client.submit(0, x, counts, local_ids, weights, "f32") for _ in range(in_flight)]
        for request_id in ids:
            client.wait(request_id, 10.0)

    def close():
        client.shutdown()
        client.close()
        child.wait(5)
    return round_trip, None, None, close


# -- measurement ----------------------------------------------------------------------------

def measure(paths: dict, rounds: int, iterations: int) -> dict[str, np.ndarray]:
    """Seconds per round trip of every path, the paths taking turns each round."""
    samples = {name: [] for name in paths}
    for _ in range(rounds):
        for name, (round_trip, begin, end, _) in paths.items():
            if begin:
                begin()
            for _ in range(max(2, iterations // 10)):
                round_trip()
            for _ in range(iterations):
                start = time.perf_counter()
                round_trip()
                samples[name].append(time.perf_counter() - start)
            if end:
                end()
    return {name: np.array(values) for name, values in samples.items()}


def run_size(tokens: int, rounds: int, iterations: int, folder: str) -> list[tuple]:
    def ipc(name: str) -> str:
        return f"ipc://{folder}/{name}-{tokens}"
    paths = {
        "raw shm spin-flag (floor)": raw_shm_path(tokens),
        "moerun shared": moerun_path(ipc("s"), "shared", tokens),
        "moerun shared, 4 in flight": moerun_path(ipc("s4"), "shared", tokens, in_flight=4),
        "raw pyzmq ipc:// (floor)": raw_zmq_path(ipc("r"), tokens),
        "moerun stream ipc://": moerun_path(ipc("m"), "stream", tokens),
        "raw pyzmq tcp:// (floor)": raw_zmq_path("tcp://127.0.0.1:47311", tokens),
        "moerun stream tcp://": moerun_path("tcp://127.0.0.1:47312", "stream", tokens),
    }
    try:
        samples = measure(paths, rounds, iterations)
    finally:
        for *_, close in paths.values():
            close()
    in_flight = {"moerun shared, 4 in flight": 4}
    request_bytes = tokens * HIDDEN * 4 + tokens * 4 + 2 * tokens * K * 4
    reply_bytes = tokens * HIDDEN * 4
    rows = []
    for name, seconds in samples.items():
        seconds = seconds / in_flight.get(name, 1)
        median = float(np.median(seconds))
        rows.append((tokens, name, median * 1e6, float(np.percentile(seconds, 90)) * 1e6,
                     1.0 / median, (request_bytes + reply_bytes) / median / 1e9))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--decode-iters", type=int, default=300, help="per path and round")
    parser.add_argument("--batch-iters", type=int, default=10, help="per path and round")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "ADDRESS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, address = args.child
        {"moerun": serve_moerun, "raw-zmq": serve_raw_zmq, "raw-shm": serve_raw_shm}[kind](address)
        return
    folder = tempfile.mkdtemp(prefix="moerun-bench-")
    rows = (run_size(1, args.rounds, args.decode_iters, folder)
            + run_size(BATCH_TOKENS, args.rounds, args.batch_iters, folder))
    shutil.rmtree(folder, ignore_errors=True)
    print(f"H={HIDDEN} f32, K={K}; {os.cpu_count()} CPUs; 4-in-flight rows: time per request\n")
    print("| T | path | median µs | p90 µs | requests/s | GB/s (in+out) |")
    print("|---|---|---|---|---|---|")
    for tokens, name, median, p90, rate, gbps in rows:
        print(f"| {tokens} | {name} | {median:.1f} | {p90:.1f} | {rate:,.0f} | {gbps:.2f} |")


if __name__ == "__main__":
    main()
