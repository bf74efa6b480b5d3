"""Where a GPU prefill and decode step spend their time, next to the floors.

    python scripts/profile_gpu.py -m model.gguf [--device cuda:0] [-p 512] [-n 64]

Times every backend operation with device events (eager launches, the stream
synchronised per step), then the captured decode step as a whole, and prints:
GPU milliseconds per operation for one prefill of P tokens and per decoded token;
the decode step's GPU time and wall time with graphs; and the floors — bytes of
weights read per decoded token over the measured copy bandwidth, and the prefill's
matrix FLOPs over the measured f16 matrix rate.
Shape legend: T tokens, H hidden, E experts, K experts per token, F expert FFN, L layers.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig

OPERATIONS = ("embed", "rms_norm", "linear", "linears", "rope_append", "attention", "route", "silu_mul", "add")


class OpTimer:
    """Wraps the backend's operations (and the expert executor's begin) with event pairs; an
    operation called inside another (linears falling back to linear) counts in the outer one only."""

    def __init__(self, runtime: Runtime):
        self.cupy = runtime.backend.device.cupy
        self.pairs: list[tuple[str, object, object]] = []
        self.depth = 0
        backend, executor = runtime.backend, runtime.model.executor
        for name in OPERATIONS:
            setattr(backend, name, self._timed(getattr(backend, name), name))
        executor.begin = self._timed(executor.begin, "experts")

    def _timed(self, function, name):
        def timed(*args, **kwargs):
            label = name
            if name == "linear":
                weight = args[1]
                label = f"linear {weight.rows}x{weight.cols} {weight.kind}"
            if self.depth:
                return function(*args, **kwargs)
            start = self.cupy.cuda.Event()
            start.record()
            self.depth += 1
            try:
                result = function(*args, **kwargs)
            finally:
                self.depth -= 1
            end = self.cupy.cuda.Event()
            end.record()
            self.pairs.append((label, start, end))
            return result
        return timed

    def collect(self) -> dict[str, float]:
        self.cupy.cuda.Device().synchronize()
        totals: dict[str, float] = defaultdict(float)
        for label, start, end in self.pairs:
            totals[label] += self.cupy.cuda.get_elapsed_time(start, end)
        self.pairs.clear()
        return totals


def ceilings(cupy) -> tuple[float, float]:
    """Measured device copy bandwidth (bytes/s, read + write) and f16 matrix rate (FLOP/s)."""
    source = cupy.random.random(1 << 28, dtype=cupy.float32)      # 1 GiB
    target = cupy.empty_like(source)
    a = cupy.random.random((8192, 8192), dtype=cupy.float32).astype(cupy.float16)
    b = cupy.random.random((8192, 8192), dtype=cupy.float32).astype(cupy.float16)

    def timed(function, repeats: int) -> float:
        function()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(repeats):
            function()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3 / repeats

    bandwidth = 2 * source.nbytes / timed(lambda: target.__setitem__(Ellipsis, source), 10)
    rate = 2 * 8192 ** 3 / timed(lambda: cupy.matmul(a, b), 10)
    return bandwidth, rate


def decode_bytes(runtime: Runtime) -> int:
    """Weight bytes one decoded token reads: every non-expert matrix, K experts per MoE layer, the head."""
    weights, spec = runtime.model.weights, runtime.spec
    total = weights.output.data.nbytes + weights.token_embd.row_bytes
    for layer in weights.layers:
        for matrix in (layer.attn_q, layer.attn_k, layer.attn_v, layer.attn_qkv, layer.attn_output, layer.ffn_gate_inp):
            total += 0 if matrix is None else matrix.data.nbytes
    for experts in weights.experts.layers.values():
        per_expert = experts.gate_up.expert_bytes + experts.down.expert_bytes
        per_expert += 0 if spec.fused_gate_up else experts.up_stack.expert_bytes
        total += spec.n_experts_used * per_expert
    return total


def prefill_flops(runtime: Runtime, n_tokens: int) -> float:
    """Matrix FLOPs of one prefill: 2 · active weights · T, plus attention's two products."""
    spec = runtime.spec
    attention_weights = spec.hidden * (2 * spec.n_heads * spec.head_dim_k + 2 * spec.n_kv_heads * spec.head_dim_k)
    experts = 3 * spec.hidden * spec.expert_ff * spec.n_experts_used
    per_layer = 2 * n_tokens * (attention_weights + experts + spec.hidden * spec.n_experts)
    attention = 2 * 2 * spec.n_heads * spec.head_dim_k * n_tokens * n_tokens / 2
    return spec.n_layers * (per_layer + attention) + 2 * spec.hidden * spec.vocab   # head: last position only


def table(title: str, totals: dict[str, float], divide: float) -> str:
    rows = sorted(totals.items(), key=lambda item: -item[1])
    grand = sum(totals.values()) / divide
    lines = [f"\n{title}: {grand:.3f} ms of GPU time", "| operation | ms | share |", "| --- | ---: | ---: |"]
    lines += [f"| {label} | {ms / divide:.3f} | {100 * ms / divide / grand:.1f}% |" for label, ms in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("-p", "--prompt-tokens", type=int, default=512)
    parser.add_argument("-n", "--decode-tokens", type=int, default=64)
    args = parser.parse_args()
    prompt = np.random.default_rng(0).integers(0, 1000, args.prompt_tokens)
    warm_steps = 3                       # decode steps of each warm-up pass
    ctx = args.prompt_tokens + max(args.decode_tokens, warm_steps) + 1

    with Runtime(args.model, ctx=ctx, rig=RigConfig(device=args.device, graphs=True)) as runtime:
        cupy, model = runtime.backend.device.cupy, runtime.model
        bandwidth, rate = ceilings(cupy)
        # Graphs: warm up (eager, capture), then time replayed steps.
        for _ in range(2):
            cache = runtime.backend.new_cache(ctx)
            model.forward(prompt, cache, all_logits=False)
            for token in range(warm_steps):
                model.forward(np.array([token]), cache, all_logits=False)
        cache = runtime.backend.new_cache(ctx)
        started = time.perf_counter()
        model.forward(prompt, cache, all_logits=False)
        prefill_wall = time.perf_counter() - started
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        started = time.perf_counter()
        start.record(runtime.backend.device.stream)
        for token in range(args.decode_tokens):
            model.forward(np.array([token % 1000]), cache, all_logits=False)
        end.record(runtime.backend.device.stream)
        end.synchronize()
        graph_wall = (time.perf_counter() - started) / args.decode_tokens * 1e3
        graph_gpu = cupy.cuda.get_elapsed_time(start, end) / args.decode_tokens

        runtime.backend.graphs_enabled = False
        timer = OpTimer(runtime)
        cache = runtime.backend.new_cache(ctx)
        with runtime.backend.device.stream:
            cupy.cuda.profiler.start()        # what a kernel profiler (ncu --profile-from-start off) sees
            model.forward(prompt, cache, all_logits=False)
            prefill = timer.collect()
            for token in range(args.decode_tokens):
                model.forward(np.array([token % 1000]), cache, all_logits=False)
            decode = timer.collect()
            cupy.cuda.profiler.stop()

        weight_bytes = decode_bytes(runtime)
        flops = prefill_flops(runtime, args.prompt_tokens)
        print(f"device {runtime.device}: copy {bandwidth / 1e12:.2f} TB/s (read + write), "
              f"f16 matmul {rate / 1e12:.0f} TFLOP/s")
        print(f"prefill {args.prompt_tokens}: {prefill_wall * 1e3:.1f} ms wall "
              f"({args.prompt_tokens / prefill_wall:.0f} t/s); "
              f"floor {flops / rate * 1e3:.2f} ms ({flops / 1e12:.2f} TFLOP at the measured rate)")
        print(f"decode with graphs: {graph_gpu:.3f} ms GPU, {graph_wall:.3f} ms wall per token "
              f"({1e3 / graph_wall:.0f} t/s); floor {weight_bytes / bandwidth * 1e3:.3f} ms "
              f"({weight_bytes / 2**20:.0f} MiB of weights read per token at the copy rate)")
        print(table(f"prefill of {args.prompt_tokens} tokens, eager, per operation", prefill, 1))
        print(table("decode, eager, per token", decode, args.decode_tokens))


if __name__ == "__main__":
    main()
