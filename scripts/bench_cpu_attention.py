"""Attention on the CPU kernels at long positions: the last of T tokens (one for decode, a
prefill chunk's 512) with 32 query heads over 4 kv heads of 128 (the Qwen3-30B-A3B shape) sees
each number of positions; the median of repeated calls, the last token against numpy.

    python scripts/bench_cpu_attention.py --threads 1,2 --positions 1,100,512,4096
    python scripts/bench_cpu_attention.py --threads 2 --tokens 512 --positions 4608,16896 --calls 3
"""
from __future__ import annotations

import argparse

import numpy as np
from timing import call_seconds

from moerun.backends.cpu.library import AttentionShape, load_kernels

HEADS, KV_HEADS, DIM = 32, 4, 128


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """softmax(q·kᵀ·scale)·v per kv head's query heads: [NH, Dv]"""
    group = HEADS // KV_HEADS
    out = np.empty((HEADS, DIM), np.float32)
    for kv in range(KV_HEADS):
        scores = q[kv * group:(kv + 1) * group] @ keys[:, kv].T * scale
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[kv * group:(kv + 1) * group] = (p / p.sum(axis=1, keepdims=True)) @ values[:, kv]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="thread counts [default: 1,2]")
    parser.add_argument("--positions", default="1,100,512,4096", help="positions seen [default: 1,100,512,4096]")
    parser.add_argument("--tokens", type=int, default=1, help="tokens of each call (T) [default: 1]")
    parser.add_argument("--calls", type=int, default=50, help="timed calls each [default: 50]")
    args = parser.parse_args()
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels are not available here (see the notice above)")
    shape = AttentionShape(HEADS, KV_HEADS, DIM, DIM, 1, 1e-6, DIM ** -0.5)
    rng = np.random.default_rng(0)
    print(f"instruction set: {kernels.isa}; {HEADS}/{KV_HEADS} heads of {DIM}")
    print(f"{'threads':>7} {'positions':>9} {'ms':>8} {'GMAC/s/thr':>10} {'rel err':>8}")
    n_tokens = args.tokens
    for seen in (int(s) for s in args.positions.split(",")):
        start = seen - n_tokens
        keys, values = (rng.standard_normal((seen, KV_HEADS, DIM)).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((n_tokens, HEADS, DIM)).astype(np.float32)
        want = reference(q[-1], keys, values, shape.scale)
        for threads in (int(t) for t in args.threads.split(",")):
            got = kernels.attention(shape, q, start, keys, values, threads).reshape(n_tokens, HEADS, DIM)[-1]
            error = np.abs(got - want).max() / np.abs(want).max()
            times = call_seconds(lambda: kernels.attention(shape, q, start, keys, values, threads),
                                 runs=args.calls, warmup=0)
            seconds = float(np.median(times))
            macs = HEADS * 2 * DIM * (n_tokens * start + n_tokens * (n_tokens + 1) // 2)   # causal
            rate = macs / seconds / 1e9 / threads
            print(f"{threads:7d} {seen:9d} {seconds * 1e3:8.3f} {rate:10.2f} {error:8.1e}", flush=True)


if __name__ == "__main__":
    main()
