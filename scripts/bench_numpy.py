"""Prefill and decode tokens/s of the numpy reference engine on one GGUF model.

    python scripts/bench_numpy.py -m /tmp/mid.gguf -p 128 -n 32 -r 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from moerun.engine.runtime import RunStats, Runtime
from moerun.engine.sampler import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("-p", "--prompt-tokens", type=int, default=128)
    parser.add_argument("-n", "--decode-tokens", type=int, default=32)
    parser.add_argument("-r", "--repetitions", type=int, default=3)
    parser.add_argument("--ubatch", type=int, default=512)
    args = parser.parse_args()

    started = time.perf_counter()
    runtime = Runtime(args.model, ctx=args.prompt_tokens + args.decode_tokens, ubatch=args.ubatch)
    load_seconds = time.perf_counter() - started
    store = runtime.model.weights.experts.store
    for layer in np.flatnonzero(runtime.spec.moe_layers):       # dequantize every expert up front: steady state
        for expert in range(runtime.spec.n_experts):
            store.get(int(layer), expert)
    rng = np.random.default_rng(0)
    prefill, decode = [], []
    for repetition in range(args.repetitions + 1):                # the first run is a warm-up
        prompt = rng.integers(0, runtime.spec.vocab, args.prompt_tokens).tolist()
        stats = RunStats()
        for _ in runtime.generate(prompt, args.decode_tokens + 1, SamplingParams(temperature=0.0), stats=stats):
            pass
        if repetition:
            prefill.append(stats.prefill_tokens_per_second)
            decode.append(stats.decode_tokens_per_second)
    spec = runtime.spec
    print(f"model: {args.model} ({spec.family}, H={spec.hidden}, L={spec.n_layers}, "
          f"E={spec.n_experts}, K={spec.n_experts_used}, F={spec.expert_ff}, V={spec.vocab}); "
          f"load {load_seconds:.2f} s")
    print("| test | t/s mean | t/s sd |\n|---|---|---|")
    for name, values in ((f"pp{args.prompt_tokens}", prefill), (f"tg{args.decode_tokens}", decode)):
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"| {name} | {statistics.mean(values):.2f} | {sd:.2f} |")


if __name__ == "__main__":
    main()
