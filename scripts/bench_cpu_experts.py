"""One MoE layer's routed experts on the CPU: the CPU kernels against the float32 numpy path
(experts already dequantized into its cache: its best case, the same for every stored type),
per stored type and thread count.

    python scripts/bench_cpu_experts.py                          # every type, 1 and 2 threads
    python scripts/bench_cpu_experts.py --types Q4_K,Q8_0 --threads 4,16
    python scripts/bench_cpu_experts.py --types Q4_K --threads 16 --decode-experts 4,8 --gap-us 400
    python scripts/bench_cpu_experts.py --types Q4_K/Q6_K --threads 15 --decode-experts 4,8 --no-float --layers 4

Shapes of Qwen3-30B-A3B (H 2048, F 768, E 128, K 8). Decode: one token through `--decode-experts`
experts (K; a CPU daemon beside a GPU parent gets about half of them) drawn anew each step (so
their weights come from memory, as a decode step's do), the median step and the weight bytes it
read per second. A CPU with a large L3 (300 MiB on some servers) keeps much of one layer's
experts (392 MiB for Q4_K/Q6_K): `--layers N` makes N layers of experts and takes them in turn,
as a decode step does, so that a layer's weights come from memory. `--gap-us` waits (spinning, as a
daemon's serving thread does) between steps, as a daemon does between a decode step's layers.
Prefill: 512 tokens routed uniformly (about 32 per expert), the best of 3 runs. Weights are random
bytes with valid scales: speed does not depend on the values.
"""
from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from threadpoolctl import threadpool_limits
from timing import call_seconds

from moerun.backends.cpu.library import ExpertMatrices, Matrix, load_kernels
from moerun.backends.numpy_backend import QuantizedExperts
from moerun.backends.numpy_ops import grouped_ffn

T = GGMLQuantizationType
HIDDEN, FFN, EXPERTS, TOP_K = 2048, 768, 128, 8
TYPES = "Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K,F16,BF16,F32"
SCALE_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
                T.Q5_K: (0, 2), T.Q6_K: (208,)}       # f16 fields set to a small normal value
DECODE_STEPS = 40
PREFILL_TOKENS = 512


def stored(ggml_type: T, rows: int, cols: int, rng: np.random.Generator,
           experts: int = EXPERTS) -> tuple[np.ndarray, Matrix]:
    """Every expert's matrix [E, rows, cols] as stored, and its struct."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    row_bytes = cols // block_size * type_size
    if ggml_type in SCALE_FIELDS:
        raw = rng.integers(0, 256, (experts * rows * cols // block_size, type_size), dtype=np.uint8)
        for offset in SCALE_FIELDS[ggml_type]:
            raw[:, offset:offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    else:
        values = rng.standard_normal(experts * rows * cols, np.float32) * np.float32(0.02)
        raw = values if ggml_type == T.F32 else values.astype(np.float16) if ggml_type == T.F16 else \
            (values.view(np.uint32) >> 16).astype(np.uint16)
    raw = raw.view(np.uint8).reshape(experts, rows, row_bytes)
    return raw, Matrix(raw.ctypes.data, int(ggml_type), rows, cols, row_bytes, rows * row_bytes)


def float_experts(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """What the numpy path holds once it has dequantized every expert: gate, up [F, H], down [H, F]."""
    return [tuple(rng.standard_normal(shape, np.float32) * np.float32(0.02)
                  for shape in ((FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN))) for _ in range(EXPERTS)]


def decode_seconds(ffn, rng: np.random.Generator, k: int = TOP_K, gap_s: float = 0.0) -> float:
    """The median step of one token through k experts drawn anew each step, gap_s apart."""
    steps = []
    for _ in range(DECODE_STEPS + 3):
        x = rng.standard_normal((1, HIDDEN), np.float32)
        experts = rng.permutation(EXPERTS)[:k]
        idle_until = time.perf_counter() + gap_s
        while time.perf_counter() < idle_until:
            pass
        started = time.perf_counter()
        ffn(x, np.zeros(k, np.int64), experts, np.full(k, 1 / k, np.float32))
        steps.append(time.perf_counter() - started)
    return float(np.median(steps[3:]))


def prefill_seconds(ffn, rng: np.random.Generator) -> float:
    x = rng.standard_normal((PREFILL_TOKENS, HIDDEN), np.float32)
    experts = np.concatenate([rng.permutation(EXPERTS)[:TOP_K] for _ in range(PREFILL_TOKENS)])
    rows = np.repeat(np.arange(PREFILL_TOKENS), TOP_K)
    weights = np.full(len(rows), 1 / TOP_K, np.float32)
    return min(call_seconds(lambda: ffn(x, rows, experts, weights), runs=3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=TYPES,
                        help=f"stored types, GATE_UP/DOWN for two (Q4_K/Q6_K: a Q4_K_M file's) [default: {TYPES}]")
    parser.add_argument("--threads", default="1,2", help="thread counts [default: 1,2]")
    parser.add_argument("--decode-experts", default=str(TOP_K),
                        help=f"experts of a decode step, one or several counts [default: {TOP_K}]")
    parser.add_argument("--gap-us", type=float, default=0.0, help="idle time between decode steps [default: 0]")
    parser.add_argument("--no-float", action="store_true", help="skip the float32 numpy path")
    parser.add_argument("--layers", type=int, default=1, help="layers of experts, taken in turn [default: 1]")
    args = parser.parse_args()
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels are not available here (see the notice above)")
    rng = np.random.default_rng(0)
    threads = [int(t) for t in args.threads.split(",")]
    decode_experts = [int(k) for k in args.decode_experts.split(",")]
    print(f"instruction set: {kernels.isa}; shapes H {HIDDEN}, F {FFN}, E {EXPERTS}, {args.layers} layer(s); "
          f"decode steps {args.gap_us:g} us apart")
    print(f"{'type':9} {'threads':>7} {'experts':>7} {'decode ms':>10} {'GB/s':>6} {'float32':>8} {'x':>5} "
          f"{'prefill tok/s':>14} {'float32':>8} {'x':>5}")
    baseline = {} if args.no_float else float_baseline(threads, rng)
    for name in args.types.split(","):
        gate_up_type, down_type = (T[part] for part in (name.split("/") * 2)[:2])
        layers, keep = {}, []
        for index in range(args.layers):
            arrays = [stored(ggml_type, rows, cols, rng) for ggml_type, rows, cols in
                      ((gate_up_type, FFN, HIDDEN), (gate_up_type, FFN, HIDDEN), (down_type, HIDDEN, FFN))]
            layers[index] = ExpertMatrices(*(matrix for _, matrix in arrays), EXPERTS)
            keep += [raw for raw, _ in arrays]
        expert_bytes = sum(raw[0].nbytes for raw in keep[:3])
        for count in threads:
            experts = QuantizedExperts(kernels, layers, count, keep)
            calls = itertools.count()
            kernel_ffn = lambda *pairs: experts.grouped_ffn(next(calls) % args.layers, *pairs)     # noqa: E731
            prefill = prefill_seconds(kernel_ffn, rng)
            for k in decode_experts:
                decode = decode_seconds(kernel_ffn, rng, k, args.gap_us * 1e-6)
                line = f"{name:9} {count:7d} {k:7d} {decode * 1e3:10.3f} {k * expert_bytes / decode / 1e9:6.1f}"
                if baseline and k == TOP_K:
                    float_decode, float_prefill = baseline[count]
                    line += f" {float_decode * 1e3:8.2f} {float_decode / decode:5.1f}"
                else:
                    line += f" {'':8} {'':5}"
                line += f" {PREFILL_TOKENS / prefill:14.0f}"
                if baseline:
                    line += f" {PREFILL_TOKENS / float_prefill:8.0f} {float_prefill / prefill:5.1f}"
                print(line, flush=True)


def float_baseline(threads: list[int], rng: np.random.Generator) -> dict[int, tuple[float, float]]:
    """Thread count -> (decode, prefill) seconds of the float32 numpy path."""
    experts = float_experts(rng)

    def float_ffn(x, rows, ids, weights):
        return grouped_ffn(x, rows, ids, weights, lambda e: experts[e])
    seconds = {}
    for count in threads:
        with threadpool_limits(count):
            seconds[count] = decode_seconds(float_ffn, rng), prefill_seconds(float_ffn, rng)
    return seconds


if __name__ == "__main__":
    main()
