"""Prefill through expert daemons in batched and in stream mode: IPC calls and time.

    python scripts/bench_prefill_modes.py -m /tmp/mid.gguf -p 512 --daemons 2
"""
from __future__ import annotations

import argparse

import numpy as np

from moerun.engine.runtime import RunStats, Runtime
from moerun.rig.settings import RigConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("-p", "--prompt-tokens", type=int, default=512)
    parser.add_argument("--daemons", type=int, default=2, help="CPU daemons to spawn")
    parser.add_argument("--hot", type=int, default=None, help="experts per layer kept on the parent")
    parser.add_argument("--transport", default="shared")
    parser.add_argument("-r", "--repetitions", type=int, default=3)
    args = parser.parse_args()

    print(f"| mode | IPC calls | MiB sent | prefill s (best of {args.repetitions}) | pp t/s | parent wait s "
          f"| daemon compute s |\n|---|---|---|---|---|---|---|")
    for mode in ("batched", "stream"):
        rig = RigConfig(daemons=("cpu",) * args.daemons, hot=args.hot, transport=args.transport, mode=mode,
                        daemon_timeout_s=600)
        with Runtime(args.model, ctx=args.prompt_tokens, ubatch=args.prompt_tokens, rig=rig) as runtime:
            ids = np.random.default_rng(0).integers(0, runtime.spec.vocab, args.prompt_tokens).tolist()
            runtime.logits(ids)                                             # warm-up: every expert dequantized
            best = None
            for _ in range(args.repetitions):
                before = totals(runtime)
                stats = RunStats()
                runtime.logits(ids, stats)
                used = totals(runtime) - before
                if best is None or stats.prefill_seconds < best[0]:
                    best = (stats.prefill_seconds, used)
        seconds, (calls, sent, wait, compute) = best
        print(f"| {mode} | {calls:.0f} | {sent / 2**20:.1f} | {seconds:.2f} | {args.prompt_tokens / seconds:.0f} "
              f"| {wait:.2f} | {compute:.2f} |")


def totals(runtime: Runtime) -> np.ndarray:
    """calls, bytes sent, parent wait s, daemon compute s, summed over the daemons."""
    return np.array([[c.calls, c.bytes_sent, c.wait_seconds, c.compute_seconds]
                     for c in (link.client.counters for link in runtime.rig.links)]).sum(axis=0)


if __name__ == "__main__":
    main()
