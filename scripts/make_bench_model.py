"""Write a GGUF with real model dimensions and random but valid quantized weights, for `moerun bench`.

    python scripts/make_bench_model.py -o /tmp/qwen3-30b-a3b-q4_k_m.gguf
    python scripts/make_bench_model.py -o /tmp/qwen3-30b-a3b-q8_0.gguf --mix q8_0
    python scripts/make_bench_model.py -o /tmp/small.gguf --layers 4 --seed 1
    python scripts/make_bench_model.py -o /tmp/mixtral-4l.gguf --preset mixtral-8x7b --layers 4

Presets at the real shapes: qwen3-30b-a3b, qwen3-235b-a22b (qwen3moe), qwen3.6-35b-a3b (qwen35moe),
mixtral-8x7b (llama), qwen1.5-moe-a2.7b and qwen2-57b-a14b (qwen2moe, shared expert), olmoe-1b-7b.
"""
from __future__ import annotations

import argparse
import sys
import time

from moerun.writers.bench_model import (
    MIXES,
    PRESETS,
    tensor_plan,
    with_layers,
    write_bench_model,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", required=True, help="GGUF file to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    parser.add_argument("--mix", choices=sorted(MIXES), default="q4_k_m",
                        help="q4_k_m: Q4_K with Q6_K for attn_v, ffn_down_exps and output; "
                             "q5_k_m: the same with Q5_K; q8_0: every matrix Q8_0 (rows that are no whole "
                             "K-quant blocks: Q5_0, Q5_1, Q8_0 as llama.cpp picks) [default: q4_k_m]")
    parser.add_argument("--layers", type=int, default=None, help="Layer count [default: the preset's]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    shape, mix = PRESETS[args.preset], MIXES[args.mix]
    try:
        if args.layers is not None:
            shape = with_layers(shape, args.layers)
        total = sum(t.nbytes for t in tensor_plan(shape, mix))
    except ValueError as err:
        parser.error(str(err))
    print(f"writing {args.output}: {shape.name} {mix.label}, {shape.n_layers} layers, "
          f"{total / 2**30:.2f} GiB of tensor data", file=sys.stderr)
    started = time.perf_counter()
    path = write_bench_model(args.output, shape, mix, seed=args.seed, progress=_show_progress)
    seconds = time.perf_counter() - started
    size = path.stat().st_size
    print(f"\nwrote {path}: {size / 2**30:.2f} GiB in {seconds:.1f} s ({size / seconds / 1e6:.0f} MB/s)",
          file=sys.stderr)


def _show_progress(written: int, total: int) -> None:
    print(f"\r{written / 2**30:7.2f} / {total / 2**30:.2f} GiB", end="", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
