"""A gated DeltaNet layer's mixing on the GPU (GpuBackend.delta_net: the convolution, the
norms and gates, the delta rule, the gated RMSNorm) timed by CUDA events, by step size.

    python scripts/bench_delta_net.py -m /tmp/q36.gguf --tokens 1,16,64,512

Prints microseconds per layer (the last of three runs) for each step size.
Shape legend: T tokens, C channels, HV value heads, DV their dims.
"""
from __future__ import annotations

import argparse

from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True, help="a qwen35moe GGUF file")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tokens", default="1,16,64,512", help="step sizes, comma-separated")
    args = parser.parse_args()
    sizes = [int(n) for n in args.tokens.split(",")]
    with Runtime(args.model, ctx=max(sizes) + 1, rig=RigConfig(device=args.device)) as runtime:
        backend, spec = runtime.backend, runtime.spec
        cupy, shape = backend.device.cupy, spec.delta_net
        layer = next(i for i in range(spec.n_layers) if spec.is_recurrent(i))
        rng = cupy.random.default_rng(0)
        weights = (rng.standard_normal((shape.channels, shape.conv_kernel), dtype=cupy.float32) * 0.3,
                   -cupy.ones(shape.value_heads, cupy.float32), cupy.zeros(shape.value_heads, cupy.float32),
                   cupy.ones(shape.value_dim, cupy.float32))
        for n_tokens in sizes:
            inputs = (rng.standard_normal((n_tokens, shape.channels), dtype=cupy.float32),          # [T, C]
                      rng.standard_normal((n_tokens, shape.value_heads * shape.value_dim), dtype=cupy.float32),
                      rng.standard_normal((n_tokens, shape.value_heads), dtype=cupy.float32),
                      rng.standard_normal((n_tokens, shape.value_heads), dtype=cupy.float32))
            with backend.device.stream:
                for _ in range(3):
                    cache = backend.new_cache(max(sizes) + 1)
                    begin, end = cupy.cuda.Event(), cupy.cuda.Event()
                    begin.record()
                    backend.delta_net(*inputs, weights, cache, layer)
                    end.record()
                    end.synchronize()
            print(f"T={n_tokens}: {cupy.cuda.get_elapsed_time(begin, end) * 1e3:.1f} µs a layer", flush=True)


if __name__ == "__main__":
    main()
