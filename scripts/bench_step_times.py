"""Forward times of one model by chunk size and start position (each timed to its logits on
the host), then on a GPU the device time of one chunk by backend call (CUDA events around
each call of the backend and of the expert executor; steps launched eagerly).

    python scripts/bench_step_times.py -m /tmp/q36.gguf --device cuda:0
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
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with Runtime(args.model, ctx=CAPACITY, ubatch=512, rig=RigConfig(device=args.device)) as runtime:
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
        if runtime.backend.kind != "CPU":
            for start, n_tokens in ((1536, 512), (2048, 16), (2048, 8), (2048, 1)):
                print(f"{n_tokens}@{start}: device ms by call:", device_time_by_call(runtime, start, n_tokens, rng))


def device_time_by_call(runtime: Runtime, start: int, n_tokens: int, rng) -> dict[str, float]:
    """One eager chunk of n_tokens at `start`, CUDA events around every backend and executor call,
    each call begun on a drained stream (its time: its own launches and kernels, no queue before it)."""
    backend, model = runtime.backend, runtime.model
    cupy, times, events = backend.device.cupy, collections.defaultdict(float), []

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def call(*args, **kwargs):
            begin, end = cupy.cuda.Event(), cupy.cuda.Event()
            backend.device.stream.synchronize()
            begin.record(backend.device.stream)
            out = inner(*args, **kwargs)
            end.record(backend.device.stream)
            events.append((label, begin, end))
            if label == "experts.begin":
                timed(out, "finish", "experts.finish")
            return out
        setattr(owner, name, call)

    cache = backend.new_cache(CAPACITY)
    while cache.length < start:
        model.forward(rng.integers(0, 1000, 512), cache, all_logits=False)
    for name in CALLS:
        timed(backend, name, name)
    timed(model.executor, "begin", "experts.begin")
    backend.graphs_enabled = False
    model.forward(rng.integers(0, 1000, n_tokens), cache, all_logits=False)
    backend.device.stream.synchronize()
    for label, begin, end in events:
        times[label] += cupy.cuda.get_elapsed_time(begin, end)
    return {label: round(ms, 2) for label, ms in sorted(times.items(), key=lambda item: -item[1])}


if __name__ == "__main__":
    main()
