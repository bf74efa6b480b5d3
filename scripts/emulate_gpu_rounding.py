"""How far the GPU's operand roundings alone move a bench-model file's logits: the products,
attention and DeltaNet of the CPU backend recomputed in numpy (float64 by default) from the
dequantized weights, with the GPU's roundings of their inputs switched on one at a time, on the
inputs of tests/gpu/test_gpu_shapes.py (same file, seeds and regions: the first `chunk` tokens
as one chunk, 5 more as one chunk against that cache, then 3 one-token steps).

    python scripts/emulate_gpu_rounding.py --preset qwen3.6-35b-a3b --chunk 64 --flips 3
    python scripts/emulate_gpu_rounding.py --preset mixtral-8x7b --mix q8_0 --chunk 2048 --pin-routing
    python scripts/emulate_gpu_rounding.py --preset mixtral-8x7b --width real --chunk 64 --dtype float32 --expert-gib 9

The roundings (the GPU's, docs/gpu.md), on inputs of a chunk of more than 8 tokens (prefill):
  dense-act   activations of the dense products (q/k/v, attention output, DeltaNet projections,
              shared expert, LM head) to f16
  dense-w     their quantized weights dequantized to f16 (routers and other F32 matrices stay exact)
  expert-act  the routed experts' inputs and silu(gate)·up to f16
  expert-w    the routed experts' weights dequantized to f16
  attention   q, k, the softmax's probabilities and v to TF32 (10-bit mantissa, rounded to nearest;
              --tf32 trunc drops the low bits instead)
of a chunk of at most 8 tokens (the GEMVs):
  planes      activations into products with quantized weights (dense and experts, x and
              silu(gate)·up) in two 8-bit planes per 32 values, x ≈ d·(a + b/254)
and of any chunk:
  delta-f32   the DeltaNet recurrence token by token in float32 (the GPU's) instead of float64.
A variant is one of those names, several joined by '+', `exact` (none) or `gpu` (all).

Every variant is compared with the CPU backend itself (what the GPU test measures) and with
`exact`; the CPU backend (float32 activations, docs/cpu.md) is compared with `exact` too.
Per region: ‖a − b‖/‖b‖ over all logits, the worst token's own relative error, and how many
(layer, token) routings chose another set of experts than the CPU's.

With random weights many tokens' routing is a near-tie (the K-th and K+1-th router logits a
hair apart), and a rounding that flips one changes that token's logits by 5-50%: the relative
error over all logits is then the flips', not the roundings'. So the script lists the nearest
ties, how far each variant moves the margins and how many flips that makes likely; `--flips N`
runs `exact` with each of the N nearest ties flipped (what one flip costs per region), a variant
`flipA,B` flips several, and `--pin-routing` has every variant route as the CPU did (the
roundings' own error).
"""
from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moerun.backends.gpu.constants import MAX_GEMV_TOKENS
from moerun.backends.numpy_backend import StoredMatrix, load_expert
from moerun.backends.numpy_ops import l2_norm, rms_norm, sigmoid, silu, softmax
from moerun.engine.runtime import Runtime
from moerun.gguf.quants import T, dequantize
from moerun.rig.settings import RigConfig
from moerun.writers.bench_model import MIXES, PRESETS, reduced, with_layers, write_bench_model

SHORT_CHUNK, DECODE_STEPS = 5, 3     # as tests/gpu/test_gpu_shapes.py
ROUNDINGS = ("dense-act", "dense-w", "expert-act", "expert-w", "attention", "planes", "delta-f32")
REGIONS = ("first chunk", "short chunk", "decode")


def f16(x: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(dtype)


def tf32(x: np.ndarray, dtype, truncate: bool) -> np.ndarray:
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    if not truncate:                                            # to nearest, ties to even
        bits = bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))
    return (bits & np.uint32(0xFFFFE000)).view(np.float32).astype(dtype)


def planes(x: np.ndarray, dtype) -> np.ndarray:
    """x [T, K] as the GEMVs see it: per unit of 32, d = max|x| / 127, a = rint(x/d),
    b = rint((x/d - a) · 254), x ≈ d · (a + b/254) (quantize_q8 in q8_dot.cuh, in float32)."""
    units = np.asarray(x, np.float32).reshape(len(x), -1, 32)
    amax = np.abs(units).max(axis=-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    scaled = units * inverse
    a = np.rint(scaled)
    b = np.rint((scaled - a) * np.float32(254))
    return ((a + b / np.float32(254)) * (amax / np.float32(127))).reshape(x.shape).astype(dtype)


@dataclass
class Options:
    on: frozenset[str]
    dtype: type = np.float64
    truncate_tf32: bool = False
    routes: list = field(default_factory=list)        # every route() call's ids, in order
    logits: list = field(default_factory=list)        # and its router logits (float64)
    flip: frozenset = frozenset()                     # (route call, token)s whose K-th and K+1-th experts swap
    pinned: list | None = None                        # the CPU's ids of every route call: chosen again


class Emulation:
    """Patches one CPU Runtime's backend and experts; with `options` None they run as they are
    (the routing recorded all the same)."""

    def __init__(self, runtime: Runtime, dtype, expert_bytes: int):
        self.runtime, self.dtype = runtime, dtype
        self.options: Options | None = None
        self.cpu_routes: list = []
        self.cpu_logits: list = []
        self.cpu_ids: list = []
        self._dense: dict[int, np.ndarray] = {}
        self._experts: OrderedDict[tuple, tuple] = OrderedDict()
        self.expert_bytes = expert_bytes
        backend, experts = runtime.backend, runtime.model.executor.experts
        self._original = {"linear": backend.linear, "linears": backend.linears, "attention": backend.attention,
                          "delta_net": backend.delta_net, "route": backend.route, "compute": experts.compute}
        backend.linear, backend.linears, backend.attention = self.linear, self.linears, self.attention
        backend.delta_net, backend.route, experts.compute = self.delta_net, self.route, self.compute

    def on(self, name: str, n_tokens: int) -> bool:
        prefill = n_tokens > MAX_GEMV_TOKENS
        if name == "planes":
            return not prefill and name in self.options.on
        return (prefill or name == "delta-f32") and name in self.options.on

    # -- weights, dequantized once (and rounded to f16 once)
    def dense(self, weight: StoredMatrix, half: bool) -> np.ndarray:
        key = (id(weight), half)
        if key not in self._dense:
            values = dequantize(weight.raw, T(weight.struct.type)).reshape(weight.shape)
            self._dense[key] = values.astype(np.float16) if half else values.astype(self.dtype)
        return self._dense[key]

    def expert(self, layer: int, expert: int, half: bool) -> tuple:
        """gate, up, down (as float16 when `half`), the most recently used ones kept within
        expert_bytes."""
        key = (layer, expert, half)
        if key in self._experts:
            self._experts.move_to_end(key)
            return self._experts[key]
        mats = load_expert(self.runtime.gguf, self.runtime.model.spec, layer, expert)
        self._experts[key] = tuple(m.astype(np.float16 if half else self.dtype) for m in mats)
        while sum(m.nbytes for mats in self._experts.values() for m in mats) > self.expert_bytes \
                and len(self._experts) > 1:
            self._experts.popitem(last=False)
        return self._experts[key]

    # -- the patched operations
    def route(self, x, norm, router):
        """The CPU's routing, recorded with its logits; a variant's pinned to the CPU's experts
        or with near-ties flipped when its options say so."""
        h, ids, weights = self._original["route"](x, norm, router)
        options, rule = self.options, self.runtime.model.spec.rule
        routes, logits = (self.cpu_routes, self.cpu_logits) if options is None else (options.routes, options.logits)
        values = h.astype(np.float64) @ np.asarray(router, np.float64).T                  # [T, E]
        if options is None:
            self.cpu_ids.append(ids.copy())
        elif options.pinned is not None or options.flip:
            ids = options.pinned[len(routes)].copy() if options.pinned is not None else ids.copy()
            k = ids.shape[1]
            for t in [t for call, t in options.flip if call == len(routes)]:
                order = np.argsort(-values[t], kind="stable")
                ids[t] = np.concatenate([order[:k - 1], order[k:k + 1]])     # the K-th best out, the K+1-th in
            chosen = np.take_along_axis(softmax(values, axis=-1), ids, axis=1)
            weights = (chosen / chosen.sum(axis=1, keepdims=True) if rule.renormalize_topk else chosen)
            weights = weights.astype(np.float32)
        routes.append(np.sort(ids, axis=1))
        logits.append(values)
        return h, ids, weights

    def linear(self, x, weight, bias=None, residual=None):
        if self.options is None:
            return self._original["linear"](x, weight, bias, residual)
        if isinstance(weight, StoredMatrix):
            n = len(x)
            xx = f16(x, self.dtype) if self.on("dense-act", n) else (
                planes(x, self.dtype) if self.on("planes", n) else np.asarray(x, self.dtype))
            y = xx @ self.dense(weight, self.on("dense-w", n)).T.astype(self.dtype, copy=False)
        else:                                                  # F32: exact on the GPU too
            y = np.asarray(x, self.dtype) @ np.asarray(weight, self.dtype).T
        y = y.astype(np.float32)
        if bias is not None:
            y = y + bias
        return y if residual is None else residual + y

    def linears(self, x, weights, biases, norm=None):
        if self.options is None:
            return self._original["linears"](x, weights, biases, norm)
        if norm is not None:
            x = self.runtime.backend.rms_norm(x, norm)
        return tuple(self.linear(x, weight, bias) for weight, bias in zip(weights, biases))

    def compute(self, layer, x, ids, weights, out=None, residual=None):
        if self.options is None:
            return self._original["compute"](layer, x, ids, weights, out=out, residual=residual)
        n, dt = len(x), self.dtype

        def rounded(a):
            return f16(a, dt) if self.on("expert-act", n) else planes(a, dt) if self.on("planes", n) \
                else np.asarray(a, dt)

        xx = rounded(x)
        result = np.zeros(x.shape, dt)
        for e in np.unique(ids[ids >= 0]):
            rows, slots = np.nonzero(ids == e)
            gate, up, down = (m.astype(dt, copy=False) for m in self.expert(layer, int(e), self.on("expert-w", n)))
            xe = xx[rows]
            act = rounded((silu(xe @ gate.T) * (xe @ up.T)).astype(np.float32))
            result[rows] += weights[rows, slots][:, None].astype(dt) * (act @ down.T)
        result = result.astype(np.float32)
        if residual is not None:
            result = residual + result
        if out is None:
            return result
        out[...] = result
        return out

    def attention(self, q, cache, layer, positions):
        if self.options is None:
            return self._original["attention"](q, cache, layer, positions)
        keys, values = cache.rows(layer, int(positions[-1]) + 1)
        n, dt = len(q), self.dtype
        if self.on("attention", n):
            q, keys, values = (tf32(a, dt, self.options.truncate_tf32) for a in (q, keys, values))
        q, keys, values = (np.asarray(a, dt) for a in (q, keys, values))
        n_heads, head_dim = q.shape[1:]
        n_kv = keys.shape[1]
        group, start = n_heads // n_kv, int(positions[0])
        qg = q.reshape(n, n_kv, group, head_dim).transpose(1, 2, 0, 3)               # [NKV, G, T, D]
        scores = (qg @ keys.transpose(1, 2, 0)[:, None]) / np.sqrt(head_dim)          # [NKV, G, T, S]
        future = np.arange(len(keys))[None, :] > start + np.arange(n)[:, None]
        probs = softmax(np.where(future, -np.inf, scores), axis=-1)
        if self.on("attention", n):
            probs = tf32(probs, dt, self.options.truncate_tf32)
        out = probs @ values.transpose(1, 0, 2)[:, None]                              # [NKV, G, T, Dv]
        return out.transpose(2, 0, 1, 3).reshape(n, -1).astype(np.float32)

    def delta_net(self, channels, z, beta, alpha, weights, cache, layer):
        """As NumpyBackend.delta_net, token by token in float64 (float32 with delta-f32)."""
        if self.options is None:
            return self._original["delta_net"](channels, z, beta, alpha, weights, cache, layer)
        dt = np.float32 if self.on("delta-f32", len(channels)) else self.dtype
        conv_weight, a, dt_bias, norm = (np.asarray(w, dt) for w in weights)
        shape, eps, n = self.runtime.model.spec.delta_net, self.runtime.model.spec.rms_eps, len(channels)
        state = np.asarray(cache.conv[layer], dt)
        window = np.concatenate([state, np.asarray(channels, dt)])
        width = conv_weight.shape[1]
        mixed = silu(sum(window[i:i + n] * conv_weight[:, i] for i in range(width)))
        cache.conv[layer] = window[len(window) - (width - 1):].copy()
        kw = shape.key_heads * shape.key_dim
        q = l2_norm(mixed[:, :kw].reshape(n, shape.key_heads, shape.key_dim), eps)
        k = l2_norm(mixed[:, kw:2 * kw].reshape(n, shape.key_heads, shape.key_dim), eps)
        v = mixed[:, 2 * kw:].reshape(n, shape.value_heads, shape.value_dim)
        x = np.asarray(alpha, dt) + dt_bias
        decay = np.exp(np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))) * a)     # [T, HV]
        strength = sigmoid(np.asarray(beta, dt))
        ssm = np.asarray(cache.ssm[layer], dt).copy()                                     # [HV, DK, DV]
        key_head = np.arange(shape.value_heads) % shape.key_heads
        out = np.empty((n, shape.value_heads, shape.value_dim), dt)
        for t in range(n):
            qh, kh = q[t][key_head], k[t][key_head]                                       # [HV, DK]
            ssm *= decay[t][:, None, None]
            delta = strength[t][:, None] * (v[t] - np.einsum("hk,hkv->hv", kh, ssm))
            ssm += kh[:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hk,hkv->hv", qh, ssm) / np.sqrt(shape.key_dim)
        cache.ssm[layer] = ssm
        gate = np.asarray(z, dt).reshape(n, shape.value_heads, shape.value_dim)
        return (rms_norm(out, norm, eps) * silu(gate)).reshape(n, -1).astype(np.float32)


def step_logits(runtime: Runtime, ids: list[int], chunk: int, decode: list[int]) -> list[np.ndarray]:
    """As test_gpu_shapes.step_logits, cut into the three regions."""
    cache = runtime.backend.new_cache(runtime.ctx)
    rows = [runtime.model.forward(np.asarray(ids[start:start + chunk]), cache, all_logits=True)
            for start in range(0, len(ids), chunk)]
    steps = [runtime.model.forward(np.array([token]), cache, all_logits=False) for token in decode]
    rows = np.concatenate(rows).astype(np.float64)
    return [rows[:chunk], rows[chunk:], np.concatenate(steps).astype(np.float64)]


def errors(got: list[np.ndarray], want: list[np.ndarray]) -> list[tuple[float, float]]:
    """Per region: ‖got − want‖/‖want‖ and the worst token's own."""
    out = []
    for g, w in zip(got, want):
        tokens = np.linalg.norm(g - w, axis=1) / np.linalg.norm(w, axis=1)
        out.append((float(np.linalg.norm(g - w) / np.linalg.norm(w)), float(tokens.max())))
    return out


def route_flips(routes: list, want: list) -> int:
    """(layer call, token) routings whose expert set differs."""
    return sum(int(np.any(a != b, axis=1).sum()) for a, b in zip(routes, want))


def near_ties(logits: list, k: int, layers: int, chunk: int) -> list[tuple[float, int, str, int]]:
    """Every (route call, token) by its routing margin, the K-th best logit minus the K+1-th:
    (margin, call, its forward's region, token within the forward), smallest first. Route calls
    come `layers` a forward: the first chunk's, the short chunk's (in chunks of `chunk`), decode's."""
    short = -(-SHORT_CHUNK // chunk)
    ties = []
    for call, values in enumerate(logits):
        forward = call // layers
        region = REGIONS[0] if forward == 0 else REGIONS[1] if forward <= short else REGIONS[2]
        top = -np.sort(-values, axis=1)
        ties += [(float(m), call, region, t) for t, m in enumerate(top[:, k - 1] - top[:, k])]
    return sorted(ties)


def margin_shift(logits: list, want: list, k: int, layers: int) -> list[tuple[float, float, float]]:
    """How far `logits` move the margins of `want` (each token's K-th best logit minus its K+1-th,
    the experts want's order picks), per MoE layer (route calls come `layers` a forward): the
    shifts' standard deviation σ (an earlier layer's flips make it large), their robust σ
    (1.4826 · median |shift|), and the expected number of routings that flip, Σ P(shift < -margin)
    over the layer's tokens, the shift normal of the robust σ."""
    from math import erfc, sqrt
    out = []
    for layer in range(layers):
        shifts, margins = [], []
        for got, ref in list(zip(logits, want))[layer::layers]:
            order = np.argsort(-ref, axis=1, kind="stable")[:, k - 1:k + 1]                   # [T, 2]
            ref_pair, got_pair = np.take_along_axis(ref, order, axis=1), np.take_along_axis(got, order, axis=1)
            margins.append(ref_pair[:, 0] - ref_pair[:, 1])
            shifts.append(got_pair[:, 0] - got_pair[:, 1] - margins[-1])
        shifts, margins = np.concatenate(shifts), np.concatenate(margins)
        sigma, robust = float(np.std(shifts)), float(1.4826 * np.median(np.abs(shifts)))
        expected = sum(0.5 * erfc(m / (robust * sqrt(2))) for m in margins) if robust > 0 else 0.0
        out.append((sigma, robust, float(expected)))
    return out


def variant_set(name: str) -> frozenset[str]:
    if name == "exact" or name.startswith("flip"):
        return frozenset()
    if name == "gpu":
        return frozenset(ROUNDINGS)
    parts = frozenset(name.split("+"))
    groups = {"dense": {"dense-act", "dense-w"}, "experts": {"expert-act", "expert-w"}}
    expanded = frozenset(r for p in parts for r in groups.get(p, {p}))
    unknown = expanded - set(ROUNDINGS)
    if unknown:
        raise SystemExit(f"unknown rounding {', '.join(sorted(unknown))} (have {', '.join(ROUNDINGS)})")
    return expanded


def bench_file(preset: str, mix: str, width: str, folder: Path) -> tuple:
    """The file test_gpu_shapes.py writes for (preset, mix, width), made once in `folder`."""
    shape = PRESETS[preset]
    layers = shape.hybrid.full_attention_interval if shape.hybrid else 1
    shape = with_layers(shape, layers) if width == "real" else reduced(shape, n_layers=max(2, layers))
    path = folder / f"{preset}-{mix}-{width}.gguf"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_bench_model(path, shape, MIXES[mix], seed=5)
    return shape, path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--preset", default="qwen3.6-35b-a3b", choices=[p for p in PRESETS])
    parser.add_argument("--mix", default="q4_k_m", choices=list(MIXES))
    parser.add_argument("--width", default="reduced", choices=("reduced", "real"))
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--variants", nargs="+",
                        default=["exact", "gpu", *ROUNDINGS[:5], "planes"],
                        help="exact, gpu, a rounding, or several joined by '+' (dense, experts: both of theirs); "
                             "flipA,B,..: exact with those of the nearest routing ties flipped (0: the nearest)")
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"),
                        help="of the recomputed products (float32 for real-width files: half the memory)")
    parser.add_argument("--expert-gib", type=float, default=4.0,
                        help="dequantized experts kept at most (the others dequantized again on use)")
    parser.add_argument("--tf32", default="nearest", choices=("nearest", "trunc"))
    parser.add_argument("--pin-routing", action="store_true",
                        help="every variant routes each token to the CPU's experts (weights from its own logits): "
                             "the roundings' error without routing flips")
    parser.add_argument("--flips", type=int, default=0,
                        help="also run `exact` with each of the N nearest routing ties flipped, one at a time")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/emulate_gpu_rounding"),
                        help="where the bench files are written (once)")
    args = parser.parse_args()

    shape, path = bench_file(args.preset, args.mix, args.width, args.folder)
    rng = np.random.default_rng(args.chunk)
    ids = rng.integers(0, shape.vocab, args.chunk + SHORT_CHUNK).tolist()
    decode = rng.integers(0, shape.vocab, DECODE_STEPS).tolist()
    print(f"{shape.name} {args.mix}, {shape.n_layers} layers, hidden {shape.hidden}, chunk {args.chunk}")
    with Runtime(path, ctx=args.chunk + SHORT_CHUNK + DECODE_STEPS, rig=RigConfig(device="cpu")) as runtime:
        emulation = Emulation(runtime, np.dtype(args.dtype).type, int(args.expert_gib * 2**30))
        began = time.perf_counter()
        cpu = step_logits(runtime, ids, args.chunk, decode)
        print(f"cpu backend: {time.perf_counter() - began:.1f} s")
        results = {}
        k = runtime.model.spec.n_experts_used
        moe_layers = sum(runtime.model.spec.moe_layers)
        ties = near_ties(emulation.cpu_logits, k, moe_layers, args.chunk)
        flips = [f"flip{i}" for i in range(args.flips)]
        for name in dict.fromkeys(["exact", *args.variants, *flips]):
            emulation.options = Options(variant_set(name), emulation.dtype, args.tf32 == "trunc")
            if args.pin_routing and not name.startswith("flip"):
                emulation.options.pinned = emulation.cpu_ids
            if name.startswith("flip"):              # flipN, or flipA,B,...: those of the nearest ties
                emulation.options.flip = frozenset((ties[int(i)][1], ties[int(i)][3]) for i in name[4:].split(","))
            began = time.perf_counter()
            results[name] = (step_logits(runtime, ids, args.chunk, decode), emulation.options.routes,
                             emulation.options.logits)
            emulation.options = None
            print(f"{name}: {time.perf_counter() - began:.1f} s")

    print(f"\nnearest routing ties (margin of the K-th best router logit over the K+1-th; route calls "
          f"in order, {moe_layers} a forward):")
    for i, (margin, call, region, token) in enumerate(ties[:max(5, args.flips)]):
        label = f"flip{i}" if i < args.flips else ""
        print(f"  {label:6} margin {margin:.2e}  call {call:3}  {region}, token {token}")
    for name, (_, _, logits) in results.items():
        if not name.startswith("flip"):
            layers = margin_shift(logits, emulation.cpu_logits, k, moe_layers)
            print(f"  {name} vs cpu, per layer: the margins move by σ (robust σ), routings expected to flip: "
                  + ", ".join(f"{sigma:.1e} ({robust:.1e}) {expected:.2f}" for sigma, robust, expected in layers))
    exact, exact_routes, _ = results["exact"]
    header = "".join(f" | {region:^19}" for region in REGIONS)
    print(f"\n{'':24}{header} | routings ≠ the other")
    print(f"{'(all, worst token)':24}" + " | all      worst     " * 3 + " |")
    rows = [("cpu vs exact", cpu, exact, route_flips(emulation.cpu_routes, exact_routes))]
    for name, (logits, routes, _) in results.items():
        if name != "exact":
            rows.append((f"{name} vs cpu", logits, cpu, route_flips(routes, emulation.cpu_routes)))
            rows.append((f"{name} vs exact", logits, exact, route_flips(routes, exact_routes)))
    for label, got, want, flips in rows:
        cells = "".join(f" | {all_:8.2e} {worst:8.2e}  " for all_, worst in errors(got, want))
        print(f"{label:24}{cells} | {flips}")


if __name__ == "__main__":
    main()
