"""The CPU's gated delta rule (numpy_ops.gated_delta_rule) in chunks against one token at a time,
at the shape of Qwen3.5/3.6-35B-A3B's DeltaNet layers (32 value heads over 16 key heads of 128):
the best of a few calls each, and the chunked outputs' largest difference from the token steps'.
The last column is all T tokens in one chunk (`delta_rule_chunk`), one token included.

    python scripts/bench_delta_rule.py --tokens 1,2,8,32,512 --chunks 16,32,64
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from moerun.backends.numpy_ops import delta_rule_chunk, delta_rule_token, gated_delta_rule, l2_norm, sigmoid, softplus

VALUE_HEADS, KEY_HEADS, DIM = 32, 16, 128


def inputs(n_tokens: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """q, k [T, HK, DK], v [T, HV, DV], decay and beta [T, HV], state [HV, DK, DV]"""
    rng = np.random.default_rng(seed)
    q, k = (l2_norm(rng.standard_normal((n_tokens, KEY_HEADS, DIM)).astype(np.float32), 1e-6) for _ in range(2))
    v = rng.standard_normal((n_tokens, VALUE_HEADS, DIM)).astype(np.float32)
    a = -np.exp(rng.uniform(-2, 1, VALUE_HEADS)).astype(np.float32)
    decay = softplus(rng.standard_normal((n_tokens, VALUE_HEADS)).astype(np.float32)) * a
    beta = sigmoid(rng.standard_normal((n_tokens, VALUE_HEADS)).astype(np.float32))
    state = (0.1 * rng.standard_normal((VALUE_HEADS, DIM, DIM))).astype(np.float32)
    return q, k, v, decay, beta, state


def token_steps(q, k, v, decay, beta, state) -> np.ndarray:
    """The rule a token at a time -> [T, HV, DV]"""
    return np.stack([delta_rule_token(q[t], k[t], v[t], decay[t], beta[t], state) for t in range(len(v))])


def best_of(rule: Callable[..., np.ndarray], args: tuple[np.ndarray, ...], calls: int) -> tuple[float, np.ndarray]:
    """The fastest of `calls` calls in seconds after one untimed (each on a fresh copy of the
    state), and the output."""
    *tensors, state = args
    rule(*tensors, state.copy())
    times = []
    for _ in range(calls):
        fresh = state.copy()
        started = time.perf_counter()
        out = rule(*tensors, fresh)
        times.append(time.perf_counter() - started)
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,512", help="token counts [default: 1,2,4,8,16,32,64,512]")
    parser.add_argument("--chunks", default="16,24,32,48,64,128", help="chunk sizes [default: 16,24,32,48,64,128]")
    parser.add_argument("--calls", type=int, default=5, help="timed calls each [default: 5]")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"{VALUE_HEADS}/{KEY_HEADS} heads of {DIM}; ms, best of {args.calls} (largest difference / largest output)")
    print(f"{'T':>5} {'a token at a time':>17} " + " ".join(f"{f'C={c}':>17}" for c in chunks) + f" {'one chunk':>17}")
    for n_tokens in (int(t) for t in args.tokens.split(",")):
        tensors = inputs(n_tokens)
        seconds, want = best_of(token_steps, tensors, args.calls)
        cells = []
        rules = [lambda *xs, chunk=chunk: gated_delta_rule(*xs, chunk=chunk) for chunk in chunks] + [delta_rule_chunk]
        for rule in rules:
            chunked, got = best_of(rule, tensors, args.calls)
            error = np.abs(got - want).max() / np.abs(want).max()
            cells.append(f"{chunked * 1e3:8.2f} ({error:.0e})")
        print(f"{n_tokens:5d} {seconds * 1e3:17.2f} " + " ".join(f"{c:>17}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
