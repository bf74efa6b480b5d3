"""How far the GPU's f16 KV cache moves a model's logits from the f32 cache's: relative error of
all logits of one random prompt, and the share of positions whose argmax agrees, prefilled in
chunks of a few tokens (decode attention) and in one chunk (prefill attention).

    python scripts/kv_dtype_error.py MODEL.gguf [--device cuda:0] [--tokens 256]
"""
from __future__ import annotations

import argparse

import numpy as np

from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig


def logits(model: str, device: str, ids: list[int], ubatch: int, kv_dtype: str) -> np.ndarray:
    with Runtime(model, ctx=len(ids), ubatch=ubatch, rig=RigConfig(device=device, kv_dtype=kv_dtype)) as runtime:
        return runtime.logits(ids).astype(np.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    ids = np.random.default_rng(0).integers(0, 1000, args.tokens).tolist()
    for ubatch in (8, args.tokens):
        half, full = (logits(args.model, args.device, ids, ubatch, kv) for kv in ("f16", "f32"))
        error = np.linalg.norm(half - full) / np.linalg.norm(full)
        same = np.mean(half.argmax(-1) == full.argmax(-1))
        print(f"chunks of {ubatch}: f16 vs f32 cache, relative error {error:.2e}, argmax equal at {same:.1%}")


if __name__ == "__main__":
    main()
