"""Write a synthetic qwen3moe GGUF with random weights, for benchmarks.

    python scripts/make_synthetic_model.py -o /tmp/mid.gguf --preset mid
"""
from __future__ import annotations

import argparse
import dataclasses

from moerun.writers.demo import demo_corpus
from moerun.writers.synthetic import SyntheticConfig, write_synthetic_model

PRESETS = {
    # hidden 1024, 8 layers, 32 experts, top-4: the mid-size numpy benchmark model
    "mid": SyntheticConfig(name="synthetic-mid", n_layers=8, hidden=1024, n_heads=16, n_kv_heads=4,
                           head_dim=64, n_experts=32, n_experts_used=4, expert_ff=512, vocab_size=32000),
    "tiny": SyntheticConfig(name="synthetic-tiny"),
    # skewed routing, for placement benchmarks: 32 experts, a few of them routed to far more often
    "skewed": SyntheticConfig(name="synthetic-skewed", n_layers=4, hidden=512, n_heads=8, n_kv_heads=2,
                              head_dim=64, n_experts=32, n_experts_used=4, expert_ff=256, vocab_size=2048,
                              router_skew=3.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="mid")
    parser.add_argument("--ftype", default=None, help="F32, F16, BF16, Q8_0 or Q4_0 [default: the preset's]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = dataclasses.replace(PRESETS[args.preset], seed=args.seed)
    if args.ftype:
        config = dataclasses.replace(config, ftype=args.ftype)
    corpus = demo_corpus()
    path = write_synthetic_model(args.output, config, corpus, bigram_head=False)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): {config}")


if __name__ == "__main__":
    main()
