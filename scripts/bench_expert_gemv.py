"""The decode expert kernels alone (gate/up with SwiGLU, then down with the weighted sum), timed
with caches cold: random weights for 12 layers of experts, a different layer and random experts
each call, so that every call reads its weights from memory as a decode step does (the weights
of one layer would stay in L2 between calls). Each kernel tree given (with the kernels' names
and arguments of this checkout) is compiled and timed in turn, twice, so that two trees compare
in one run on one GPU.

    python scripts/bench_expert_gemv.py                              # this checkout's kernels
    python scripts/bench_expert_gemv.py --hidden 4096 --ffn 14336 --experts 8 --top-k 2   # Mixtral's shape

Prints µs per call (CUDA graphs of 96 calls, replayed) and the weight bytes read per µs.
Shape legend: H hidden, F expert FFN width, E experts, K experts per token, P pairs = K at one token.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from moerun.backends.gpu.constants import UNIT, defines
from moerun.backends.gpu.experts import DOWN_WARPS, decode_down_rows, decode_gate_up_shape
from moerun.backends.gpu.library import KERNEL_DIR, stage_stride

CALLS = 96
LAYERS = 12
ROW_BYTES = {"q8_0": (34, 32), "q4_k": (144, 256), "q5_k": (176, 256), "q6_k": (210, 256)}   # bytes per block of values


def row_bytes(kind: str, width: int) -> int:
    block_bytes, values = ROW_BYTES[kind]
    return width // values * block_bytes


def timed(cupy, stream, launch) -> float:
    """Mean µs of launch(i) over graphs of CALLS calls, i = 0..CALLS-1."""
    with stream:
        launch(0)
        stream.begin_capture()
        for i in range(CALLS):
            launch(i)
        graph = stream.end_capture()
        graph.launch(stream)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(5):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / (5 * CALLS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", action="append", type=Path, help="a kernel tree (repeatable) [default: this one]")
    parser.add_argument("--types", default="q4_k,q8_0,q6_k", help="weight types, comma-separated")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    import cupy

    hidden, ffn, n_experts, top_k = args.hidden, args.ffn, args.experts, args.top_k
    trees = args.kernels or [KERNEL_DIR]
    modules = [cupy.RawModule(code=(tree / "moerun.cu").read_text(),
                              options=("-std=c++17", f"-I{tree.resolve()}", *defines())) for tree in trees]
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((1, hidden)).astype(np.float32))                  # [1, H]
    xq, xds = cupy.empty((1, 2 * hidden), cupy.int8), cupy.empty((1, hidden // UNIT, 2), cupy.float32)
    modules[0].get_function("quantize_q8")((1,), (hidden // UNIT,), (x, np.int64(hidden // UNIT), xq, xds))
    ids = cupy.asarray(np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(CALLS)]).astype(np.int32))
    weights = cupy.full((top_k,), 1.0 / top_k, cupy.float32)                               # [K]
    aq, ads = cupy.empty((top_k, 2 * ffn), cupy.int8), cupy.empty((top_k, ffn // UNIT, 2), cupy.float32)
    out = cupy.empty((1, hidden), cupy.float32)
    for kind in args.types.split(","):
        gate_up_row, down_row = row_bytes(kind, hidden), row_bytes(kind, ffn)
        gate_up_expert, down_expert = gate_up_row * ffn, down_row * hidden
        layers = [[cupy.random.randint(0, 255, n_experts * size, dtype=cupy.uint8)
                   for size in (gate_up_expert, gate_up_expert, down_expert)] for _ in range(LAYERS)]
        (gate_up_rows, gate_up_group), (group, down_rows) = (decode_gate_up_shape(hidden, ffn),
                                                             decode_down_rows(ffn // UNIT, top_k))
        warps = min(top_k, DOWN_WARPS)
        stride = stage_stride(32 // group * down_rows * down_row, warps)

        def gate_up(module, i):
            gate, up, _ = layers[i % LAYERS]
            module.get_function(f"moe_gate_up_q8_{kind}_r{gate_up_rows}")(
                (ffn // UNIT, top_k), (UNIT * gate_up_group // gate_up_rows,),
                (gate, up, np.int64(gate_up_expert), np.int64(gate_up_row), xq, xds, np.int32(hidden), ids[i],
                 np.int32(top_k), aq, ads, np.int32(ffn), np.int32(gate_up_group)))

        def down(module, i):
            _, _, stack = layers[i % LAYERS]
            module.get_function(f"moe_down_q8_{kind}_r{down_rows}")(
                (-(-hidden * group // (32 * down_rows)), 1), (32 * warps,),
                (stack, np.int64(down_expert), np.int64(down_row), aq, ads, np.int32(ffn), ids[i], weights,
                 np.int32(top_k), out, np.uint64(0), np.int32(hidden), np.int32(stride), np.int32(group)),
                shared_mem=stride * warps)

        for _ in range(2):
            for tree, module in zip(trees, modules):
                kernels = (("gate/up", gate_up, 2 * top_k * gate_up_expert), ("down", down, top_k * down_expert))
                for name, launch, read in kernels:
                    us = timed(cupy, stream, lambda i: launch(module, i))
                    print(f"{kind:5} {name:8} {us:7.2f} us {read / us / 1e6:5.2f} TB/s  {tree}", flush=True)
        layers.clear()
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
