"""One matrix's product on the CPU kernels (moe_matmul, straight from the stored blocks) against
float32 numpy on the dequantized matrix, per stored type, token count and thread count.

    python scripts/bench_cpu_dense.py                                  # Q4_K, Q6_K, Q8_0; T 1, 512
    python scripts/bench_cpu_dense.py --types Q4_K --tokens 1,4,64,512 --shapes q,head --threads 1,2

Shapes of Qwen3-30B-A3B: q (attn_q, N 4096 x n 2048), o (attn_output, 2048 x 4096), head (the LM
head, 151936 x 2048). Each call is timed alone, the best of several (weights of the small shapes
then come from the caches, the head's from memory). Columns: microseconds per call, multiply-adds
per second per thread (GMAC/s), the stored bytes read per second (GB/s).
Shape legend: T tokens, N a matrix's rows, n its columns.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from bench_cpu_experts import T, stored
from threadpoolctl import threadpool_limits

from moerun.backends.cpu.library import load_kernels

SHAPES = {"q": (4096, 2048), "o": (2048, 4096), "head": (151936, 2048)}     # N, n
BUDGET_S = 1.0                    # time spent per measurement, at least 3 calls


def best_seconds(call) -> float:
    call()
    runs, started = [], time.perf_counter()
    while len(runs) < 3 or time.perf_counter() - started < BUDGET_S:
        begin = time.perf_counter()
        call()
        runs.append(time.perf_counter() - begin)
    return min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0", help="stored types [default: Q4_K,Q6_K,Q8_0]")
    parser.add_argument("--shapes", default="q,o,head", help=f"of {', '.join(SHAPES)} [default: all]")
    parser.add_argument("--tokens", default="1,512", help="token counts T [default: 1,512]")
    parser.add_argument("--threads", default="1,2", help="thread counts [default: 1,2]")
    parser.add_argument("--float", action="store_true", help="also float32 numpy on the dequantized matrix")
    args = parser.parse_args()
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels are not available here (see the notice above)")
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in args.tokens.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    print(f"instruction set: {kernels.isa}")
    print(f"{'type':5} {'shape':>5} {'T':>4} {'threads':>7} {'us':>10} {'GMAC/s/thr':>10} {'GB/s':>7}")
    for shape in args.shapes.split(","):
        rows, cols = SHAPES[shape]
        for name in args.types.split(",") + (["float32"] if args.float else []):
            if name == "float32":
                weights = rng.standard_normal((rows, cols), np.float32)
                nbytes = weights.nbytes
            else:
                raw, matrix = stored(T[name], rows, cols, rng, experts=1)
                nbytes = raw.nbytes
            for n_tokens in tokens:
                x = rng.standard_normal((n_tokens, cols), np.float32)
                for count in threads:
                    if name == "float32":
                        with threadpool_limits(count):
                            seconds = best_seconds(lambda: x @ weights.T)
                    else:
                        seconds = best_seconds(lambda: kernels.matmul([matrix], x, count))
                    gmacs = n_tokens * rows * cols / seconds / 1e9 / count
                    print(f"{name:5} {shape:>5} {n_tokens:4d} {count:7d} {seconds * 1e6:10.1f} {gmacs:10.2f} "
                          f"{nbytes / seconds / 1e9:7.2f}", flush=True)


if __name__ == "__main__":
    main()
