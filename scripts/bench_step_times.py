"""Forward times of one model by chunk size and start position (each timed to its logits on
the host), then the time of one chunk by backend call: on a GPU the device time (CUDA events
around each call of the backend and of the expert executor; steps launched eagerly), on the CPU
the wall time of each call (what does not shrink with --threads is the serial part).

    python scripts/bench_step_times.py -m /tmp/q36.gguf --device cuda:0
    python scripts/bench_step_times.py -m /tmp/moerun-bench-4-layers.gguf --threads 16
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig

CAPACITY = 2200
CALLS = ("add", "attention", "delta_net", "embed", "linear", "linears", "query_gate", "rms_norm", "rope_append",
         "route", "sigmoid_gate")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rig = RigConfig(device=args.device, threads=args.threads)
    with Runtime(args.model, ctx=CAPACITY, ubatch=512, rig=rig) as runtime:
        def forward(cache, n_tokens: int) -> float:
            started = time.perf_counter()
            runtime.model.forward(rng.integers(0, 1000, n_tokens), cache, all_logits=False)
            return (time.perf_counter() - started) * 1e3

        for round_ in (1, 2):                     # the second round: every shape seen before
            cache, row = runtime.backend.new_cache(CAPACITY), []
            for n_tokens in (512, 512, 512, 512, 16, 8, 1):
                row.append(f"{n_tokens}@{cache.length} {forward(cache, n_tokens):.1f}")
            cache = runtime.backend.new_cache(CAPACITY)
            row += [f"{n}@{cache.length} {forward(cache, n):.1f}" for n in (16, 64, 32)]
            print(f"round {round_}, ms (tokens@position):", ", ".join(row))
        on_cpu = runtime.backend.kind == "CPU"
        by_call, kind = (wall_time_by_call, "wall") if on_cpu else (device_time_by_call, "device")
        for start, n_tokens in ((0, 512), (1536, 512), (2048, 16), (2048, 8), (2048, 1)):
            print(f"{n_tokens}@{start}: {kind} ms by call:", by_call(runtime, start, n_tokens, rng))


def wall_time_by_call(runtime: Runtime, start: int, n_tokens: int, rng) -> dict[str, float]:
    """One chunk of n_tokens at `start` on the CPU, the wall time of every backend and executor
    call summed by name; "rest" is the forward's time outside them (Python between calls)."""
    times = collections.defaultdict(float)

    def timer(label: str, inner):
        def call(*args, **kwargs):
            begin = time.perf_counter()
            out = inner(*args, **kwargs)
            times[label] += (time.perf_counter() - begin) * 1e3
            return out
        return call

    forward_ms = chunk_by_call(runtime, start, n_tokens, rng, timer)
    times["rest"] = forward_ms - sum(times.values())
    return {label: round(ms, 2) for label, ms in sorted(times.items(), key=lambda item: -item[1])}


def device_time_by_call(runtime: Runtime, start: int, n_tokens: int, rng) -> dict[str, float]:
    """One eager chunk of n_tokens at `start`, CUDA events around every backend and executor call,
    each call begun on a drained stream (its time: its own launches and kernels, no queue before it)."""
    backend = runtime.backend
    cupy, times, events = backend.device.cupy, collections.defaultdict(float), []

    def timer(label: str, inner):
        def call(*args, **kwargs):
            begin, end = cupy.cuda.Event(), cupy.cuda.Event()
            backend.device.stream.synchronize()
            begin.record(backend.device.stream)
            out = inner(*args, **kwargs)
            end.record(backend.device.stream)
            events.append((label, begin, end))
            return out
        return call

    backend.graphs_enabled = False
    chunk_by_call(runtime, start, n_tokens, rng, timer)
    backend.device.stream.synchronize()
    for label, begin, end in events:
        times[label] += cupy.cuda.get_elapsed_time(begin, end)
    return {label: round(ms, 2) for label, ms in sorted(times.items(), key=lambda item: -item[1])}


def chunk_by_call(runtime: Runtime, start: int, n_tokens: int, rng, timer) -> float:
    """A fresh cache prefilled to `start`, then one chunk of n_tokens with every backend call of
    CALLS and the executor's begin (and the finish of what it returns) as timer(label, method)
    returns it; the methods are the instances' own again after. Returns the chunk's wall ms."""
    backend, model = runtime.backend, runtime.model

    def wrap(owner, name: str, label: str) -> None:
        inner = timer(label, getattr(owner, name))

        def call(*args, **kwargs):
            out = inner(*args, **kwargs)
            if label == "experts.begin":
                wrap(out, "finish", "experts.finish")
            return out
        setattr(owner, name, call)

    cache = backend.new_cache(CAPACITY)
    while cache.length < start:
        model.forward(rng.integers(0, 1000, 512), cache, all_logits=False)
    for name in CALLS:
        wrap(backend, name, name)
    wrap(model.executor, "begin", "experts.begin")
    begin = time.perf_counter()
    try:
        model.forward(rng.integers(0, 1000, n_tokens), cache, all_logits=False)
    finally:
        for name in CALLS:
            vars(backend).pop(name, None)
        vars(model.executor).pop("begin", None)
    return (time.perf_counter() - begin) * 1e3


if __name__ == "__main__":
    main()
