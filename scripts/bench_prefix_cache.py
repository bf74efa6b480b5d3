"""Time to first token of a request whose prompt repeats a long prefix: the first request
(everything prefilled, a snapshot taken every INTERVAL tokens), a second one with the same
prefix and another question (resumed from the prefix's last snapshot in RAM), and the second
with a third question after a restart (a new runtime that finds the prefix's snapshot in the
folder on disk). Each runtime first serves an unrelated request of the same shape (a
prefix-length prompt and a question), so that what a runtime pays once for a shape (its
start-up, a step's first run and its capture as a graph) is in none of the figures.

    python scripts/bench_prefix_cache.py -m /tmp/qwen36-4l.gguf --prefix 2048 --device cpu

Prints the three times, their ratios to the first, and the milliseconds of each spent in the
prefix lookup (a file's read there), the restore and the forward passes.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from moerun.engine.prefix_cache import PrefixCache
from moerun.engine.runtime import RunStats, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.rig.settings import RigConfig

QUESTION_TOKENS = 16
INTERVAL = 1024         # --snapshot-interval: the prefix's tokens are a multiple of it by default


def first_token_seconds(runtime: Runtime, prompt: list[int]) -> tuple[float, int, dict[str, float]]:
    """Seconds from the request to its first sampled token, the prompt tokens restored, and
    the seconds spent in its lookup (a file read there), restore and forward passes."""
    stats, spent = RunStats(), dict.fromkeys(("lookup", "restore", "forward"), 0.0)
    timed = {"lookup": (runtime.prefix_cache, "longest"), "restore": (runtime.backend, "restore_cache"),
             "forward": (runtime.model, "forward")}
    for name, (owner, method) in timed.items():
        setattr(owner, method, _timing(getattr(owner, method), spent, name))
    started = time.perf_counter()
    try:
        next(iter(runtime.generate(prompt, 1, SamplingParams(temperature=0.0), stats=stats)))
    finally:
        for owner, method in timed.values():
            delattr(owner, method)
    return time.perf_counter() - started, stats.restored_tokens, spent


def _timing(call, spent: dict[str, float], name: str):
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - started
    return timed


def pieces(spent: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in spent.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--prefix", type=int, default=2048, help="tokens of the shared prefix [default: 2048]")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ubatch", type=int, default=512)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    folder = tempfile.mkdtemp(prefix="moerun-snapshots-")

    def runtime() -> Runtime:
        cache = PrefixCache(slots=4, interval=INTERVAL, folder=folder, disk_budget=64 << 30)
        return Runtime(args.model, ctx=args.prefix + 2 * QUESTION_TOKENS + 8, ubatch=args.ubatch,
                       rig=RigConfig(device=args.device), prefix_cache=cache)

    with runtime() as warm:                      # the model's pages in memory, its kernels built
        vocab = warm.spec.vocab
    warm_up = rng.integers(0, vocab, args.prefix + QUESTION_TOKENS).tolist()     # the same shape, unrelated
    prefix = rng.integers(0, vocab, args.prefix).tolist()
    first_question, second_question, third_question = (rng.integers(0, vocab, QUESTION_TOKENS).tolist()
                                                       for _ in range(3))
    with runtime() as server:
        first_token_seconds(server, warm_up)
        first, _, first_spent = first_token_seconds(server, prefix + first_question)
        second, restored, second_spent = first_token_seconds(server, prefix + second_question)
    with runtime() as restarted:
        first_token_seconds(restarted, warm_up)
        after_restart, restored_disk, restart_spent = first_token_seconds(restarted, prefix + third_question)
    print(f"model {args.model}, {args.prefix}-token prefix + {QUESTION_TOKENS}-token question, device {args.device}")
    print(f"first request          {first * 1e3:9.1f} ms  [{pieces(first_spent)}]")
    print(f"second request         {second * 1e3:9.1f} ms  ({second / first:.3f}x; {restored} tokens restored) "
          f"[{pieces(second_spent)}]")
    print(f"third, after restart   {after_restart * 1e3:9.1f} ms  ({after_restart / first:.3f}x; "
          f"{restored_disk} tokens restored from disk) [{pieces(restart_spent)}]")


if __name__ == "__main__":
    main()
