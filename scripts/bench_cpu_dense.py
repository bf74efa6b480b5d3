"""One matrix's product on the CPU kernels (moe_matmul, straight from the stored blocks) against
float32 numpy on the dequantized matrix, per stored type, token count and thread count.

    python scripts/bench_cpu_dense.py                                  # Q4_K, Q6_K, Q8_0; T 1, 512
    python scripts/bench_cpu_dense.py --types Q4_K --tokens 1,4,64,512 --shapes q,head --threads 1,2
    python scripts/bench_cpu_dense.py --types Q4_K --shapes q --tokens 512,4096 --panel-rows 0,4,64 --chunks 0,99999

Shapes of Qwen3-30B-A3B: q (attn_q, N 4096 x n 2048), o (attn_output, 2048 x 4096), head (the LM
head, 151936 x 2048). Each call is timed alone, the best of several (weights of the small shapes
then come from the caches, the head's from memory). Columns: microseconds per call, multiply-adds
per second per thread (GMAC/s), the stored bytes read per second (GB/s). At more tokens than
the fused tile takes, `--panel-rows` and `--chunks` set the blocking (work.h: the rows a task
dequantizes at once, the values of a row per pass over them; 0: chosen from this CPU's caches,
the default; a panel of 4 rows and a chunk past the row's end multiply one tile at a time over
whole rows, as the kernels did before the blocking); the `panel` and `chunk` columns show the
sizes in use.
Shape legend: T tokens, N a matrix's rows, n its columns.
"""
from __future__ import annotations

import argparse
import ctypes

import numpy as np
from bench_cpu_experts import T, stored
from threadpoolctl import threadpool_limits
from timing import call_seconds

from moerun.backends.cpu.library import CpuKernels, load_kernels

SHAPES = {"q": (4096, 2048), "o": (2048, 4096), "head": (151936, 2048)}     # N, n
BUDGET_S = 1.0                    # time spent per measurement, at least 3 calls


def best_seconds(call) -> float:
    return min(call_seconds(call, runs=3, budget_s=BUDGET_S))


def blocking(kernels: CpuKernels, n_cols: int, n_rows: int, threads: int) -> tuple[int, int]:
    """The panel rows and chunk values a product of n_rows x n_cols on `threads` threads uses."""
    panel, chunk = ctypes.c_int64(), ctypes.c_int64()
    kernels.lib.moe_blocking(ctypes.c_int64(n_cols), ctypes.c_int64(n_rows), ctypes.c_int(threads),
                             ctypes.byref(panel), ctypes.byref(chunk))
    return panel.value, chunk.value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0", help="stored types [default: Q4_K,Q6_K,Q8_0]")
    parser.add_argument("--shapes", default="q,o,head", help=f"of {', '.join(SHAPES)} [default: all]")
    parser.add_argument("--tokens", default="1,512", help="token counts T [default: 1,512]")
    parser.add_argument("--threads", default="1,2", help="thread counts [default: 1,2]")
    parser.add_argument("--panel-rows", default="0", help="panel rows to try, 0: from the caches [default: 0]")
    parser.add_argument("--chunks", default="0", help="chunk values to try, 0: from the caches [default: 0]")
    parser.add_argument("--float", action="store_true", help="also float32 numpy on the dequantized matrix")
    args = parser.parse_args()
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels are not available here (see the notice above)")
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in args.tokens.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    blockings = [(int(p), int(c)) for p in args.panel_rows.split(",") for c in args.chunks.split(",")]
    print(f"instruction set: {kernels.isa}")
    print(f"{'type':7} {'shape':>5} {'T':>5} {'threads':>7} {'panel':>5} {'chunk':>5} {'us':>10} {'GMAC/s/thr':>10} "
          f"{'GB/s':>7}")
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
                    for panel, chunk in blockings if name != "float32" else [(0, 0)]:
                        if name == "float32":
                            with threadpool_limits(count):
                                seconds = best_seconds(lambda: x @ weights.T)
                            sizes = "", ""
                        else:
                            kernels.lib.moe_set_blocking(ctypes.c_int64(panel), ctypes.c_int64(chunk))
                            seconds = best_seconds(lambda: kernels.matmul([matrix], x, count))
                            sizes = blocking(kernels, cols, rows, count)
                        gmacs = n_tokens * rows * cols / seconds / 1e9 / count
                        print(f"{name:7} {shape:>5} {n_tokens:5d} {count:7d} {sizes[0]:>5} {sizes[1]:>5} "
                              f"{seconds * 1e6:10.1f} {gmacs:10.2f} {nbytes / seconds / 1e9:7.2f}", flush=True)
    kernels.lib.moe_set_blocking(ctypes.c_int64(0), ctypes.c_int64(0))


if __name__ == "__main__":
    main()
