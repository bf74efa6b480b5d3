"""What writing a prefix snapshot file costs the requests' thread: a loop there sleeps 0.5 ms
at a time while the store writes a snapshot of the Qwen3.6-35B-A3B shape at 2048 positions
(10 attention layers' f16 keys and values, 30 DeltaNet layers' states: 103 MiB); prints the
write's time, the loop's longest gap, and the time to load the file back (read, digest, views).

    python scripts/bench_snapshot_writer.py
"""
from __future__ import annotations

import tempfile
import threading
import time

import numpy as np

from moerun.backends.protocol import CacheState
from moerun.engine.snapshot_store import Snapshot, SnapshotStore

POSITIONS = 2048


def qwen36_snapshot(rng: np.random.Generator) -> Snapshot:
    attention, recurrent = range(10), range(10, 40)
    state = CacheState(POSITIONS,
                       keys={i: rng.random((POSITIONS, 2, 256), np.float32).astype(np.float16) for i in attention},
                       values={i: rng.random((POSITIONS, 2, 256), np.float32).astype(np.float16) for i in attention},
                       conv={i: rng.random((3, 8192), np.float32) for i in recurrent},
                       ssm={i: rng.random((32, 128, 128), np.float32) for i in recurrent})
    return Snapshot(tuple(range(POSITIONS)), state, rng.random(1000, np.float32))


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        written, gap, loaded = measure(qwen36_snapshot(np.random.default_rng(0)), folder)
    print(f"snapshot of {POSITIONS} positions: written in {written * 1e3:.0f} ms, the requests' thread's longest "
          f"gap {gap * 1e3:.1f} ms; loaded back in {loaded * 1e3:.0f} ms")


def measure(snapshot: Snapshot, folder: str) -> tuple[float, float, float]:
    """Seconds to write it, the requests' thread's longest gap meanwhile, seconds to load it."""
    store = SnapshotStore(folder, 1 << 34, "bench", "layout")
    gaps, done = [], threading.Event()

    def requests_thread() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=requests_thread)
    ticker.start()
    started = time.perf_counter()
    store.save(snapshot)
    store.close()                                   # waits for the writer thread
    written = time.perf_counter() - started
    done.set()
    ticker.join()
    stored = next(iter(store.files.values()))
    started = time.perf_counter()
    store.load(stored)
    return written, max(gaps), time.perf_counter() - started


if __name__ == "__main__":
    main()
