"""Each decode-step operation of a model on its own, timed at full speed: every
operation is captured 50 times over into a CUDA graph and the replays timed with
device events, so launch gaps stay out of the figures. With --tokens N, the operations
of a step of N tokens (the GEMV path takes up to 8), to see what each costs a token more.

    python scripts/gpu_microbench.py -m model.gguf [--device cuda:0] [--position 512] [--tokens 8]

Prints microseconds per call and per layer (calls per layer × time), their sum
over the layers plus the head, and the captured decode step for comparison.
Shape legend: H hidden, E experts, K experts per token.
"""
from __future__ import annotations

import argparse

import numpy as np

from moerun.backends.gpu import library
from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig

REPEATS = 50


def graph_time_us(cupy, stream, operation) -> float:
    """Mean device time of one call, from a graph of REPEATS calls replayed 5 times."""
    pool = cupy.cuda.MemoryPool()
    with stream, cupy.cuda.using_allocator(pool.malloc):
        operation()                                       # load kernels before capture
        stream.begin_capture()
        for _ in range(REPEATS):
            operation()
        graph = stream.end_capture()
        graph.launch(stream)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(5):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / (5 * REPEATS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--position", type=int, default=512, help="cache positions before the timed step")
    parser.add_argument("--tokens", type=int, default=1, help="tokens of the timed step [default: 1, decode]")
    parser.add_argument("--row-group", type=int, default=library.ROW_GROUP,
                        help="threads per output row in the GEMVs (8, 16 or 32)")
    args = parser.parse_args()
    library.ROW_GROUP = args.row_group
    ctx = args.position + 64
    with Runtime(args.model, ctx=ctx, rig=RigConfig(device=args.device)) as runtime:
        backend, model, spec = runtime.backend, runtime.model, runtime.spec
        cupy, stream = backend.device.cupy, backend.device.stream
        cache = backend.new_cache(ctx)
        model.forward(np.arange(args.position) % 1000, cache, all_logits=False)
        layer = model.weights.layers[0]
        rng = np.random.default_rng(0)

        def activation(width: int):
            return cupy.asarray(rng.normal(size=(args.tokens, width)).astype(np.float32))

        x, h = activation(spec.hidden), activation(spec.hidden)
        q = activation(spec.n_heads * spec.head_dim_k)
        k, v = activation(spec.n_kv_heads * spec.head_dim_k), activation(spec.n_kv_heads * spec.head_dim_v)
        positions = cupy.asarray(np.arange(args.position, args.position + args.tokens, dtype=np.int32))
        _, ids, weights = backend.route(x, layer.ffn_norm, layer.ffn_gate_inp)
        attended = activation(spec.n_heads * spec.head_dim_v)
        operations = [  # name, calls per layer, operation
            ("attn_norm_qkv", 1, lambda: backend.linears(x, (layer.attn_q, layer.attn_k, layer.attn_v), (None,) * 3,
                                                         layer.attn_norm)),
            ("rope_append", 1, lambda: backend.rope_append(q, k, v, layer.attn_q_norm, layer.attn_k_norm,
                                                          cache, 0, positions)),
            ("attention", 1, lambda: backend.attention(q, cache, 0, positions)),
            ("attn_output", 1, lambda: backend.linear(attended, layer.attn_output, residual=x)),
            ("ffn_norm, router and top-k", 1, lambda: backend.route(x, layer.ffn_norm, layer.ffn_gate_inp)),
            ("experts", 1, lambda: model.weights.experts.compute(0, h, ids, weights)),
            ("add", 1, lambda: backend.add(x, h)),
        ]
        per_layer = {}
        for name, calls, operation in operations:
            per_layer[name] = (calls, graph_time_us(cupy, stream, operation))
        # the last row, as a step
        head = graph_time_us(cupy, stream, lambda: backend.linear(x[-1:], model.weights.output))
        layer_us = sum(calls * us for calls, us in per_layer.values())
        print("| operation | µs per call | calls per layer | µs per layer | share |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, (calls, us) in sorted(per_layer.items(), key=lambda item: -item[1][0] * item[1][1]):
            print(f"| {name} | {us:.1f} | {calls} | {calls * us:.1f} | {100 * calls * us / layer_us:.1f}% |")
        print(f"\nper layer {layer_us:.1f} µs × {spec.n_layers} layers + head {head:.1f} µs = "
              f"{(layer_us * spec.n_layers + head) / 1e3:.3f} ms a step of {args.tokens} token(s)")


if __name__ == "__main__":
    main()
