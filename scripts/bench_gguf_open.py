"""Time opening a GGUF with a Qwen-sized vocabulary: moerun's GGUFFile versus gguf.GGUFReader.

    python scripts/bench_gguf_open.py [--path FILE] [--runs N]

Writes the file (152,064 tokens, their int32 types, 151,387 merges, a few small tensors)
to --path or a temporary directory, then opens it repeatedly.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from moerun.gguf.reader import GGUFFile

N_TOKENS = 152_064
N_MERGES = 151_387
N_CONTROL = 421  # Qwen2's added tokens past the BPE vocabulary


def byte_level_alphabet() -> list[str]:
    """The 256 printable characters GPT-2 style tokenizers map bytes to."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    n_shifted = 256 - len(printable)
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(n_shifted)]


def synthetic_vocabulary(rng: np.random.Generator) -> tuple[list[str], list[str]]:
    alphabet = byte_level_alphabet()
    lengths = rng.integers(1, 16, N_TOKENS)
    text = "".join(alphabet[i] for i in rng.integers(0, len(alphabet), int(lengths.sum())))
    ends = np.cumsum(lengths).tolist()
    tokens = [text[start:end] for start, end in zip([0, *ends[:-1]], ends)]
    pairs = rng.integers(0, N_TOKENS, (N_MERGES, 2)).tolist()
    merges = [f"{tokens[a]} {tokens[b]}" for a, b in pairs]
    return tokens, merges


def write_model(path: Path) -> None:
    rng = np.random.default_rng(0)
    tokens, merges = synthetic_vocabulary(rng)
    token_types = [gguf.TokenType.NORMAL] * (N_TOKENS - N_CONTROL) + [gguf.TokenType.CONTROL] * N_CONTROL
    writer = gguf.GGUFWriter(path, "qwen2moe")
    writer.add_name("bench")
    writer.add_block_count(1)
    writer.add_context_length(32768)
    writer.add_embedding_length(64)
    writer.add_expert_count(4)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((64, 64), dtype=np.float32).astype(np.float16))
    experts = rng.standard_normal((4, 32, 64), dtype=np.float32)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", gguf.quants.quantize(experts, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def time_open(open_file: Callable[[Path], object], path: Path, runs: int) -> list[float]:
    seconds = []
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        opened = open_file(path)
        seconds.append(time.perf_counter() - start)
        del opened
    return seconds


def open_and_close(path: Path) -> None:
    GGUFFile(path).close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, help="where to write the benchmark file (default: a temporary directory)")
    parser.add_argument("--runs", type=int, default=7, help="GGUFFile opens to time (GGUFReader opens once)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.path or Path(tmp) / "vocab.gguf"
        write_model(path)
        with GGUFFile(path) as opened:
            assert len(opened.metadata["tokenizer.ggml.tokens"]) == N_TOKENS
            assert len(opened.metadata["tokenizer.ggml.merges"]) == N_MERGES

        ours = time_open(open_and_close, path, args.runs)
        theirs = time_open(gguf.GGUFReader, path, 1)

        print(f"{path.name}: {path.stat().st_size / 1e6:.1f} MB, {N_TOKENS:,} tokens, {N_MERGES:,} merges")
        print(f"{'reader':<20} {'runs':>4} {'best':>9} {'median':>9}")
        for name, seconds in (("moerun GGUFFile", ours), ("gguf.GGUFReader", theirs)):
            print(f"{name:<20} {len(seconds):>4} {min(seconds):>8.3f}s {statistics.median(seconds):>8.3f}s")
        print(f"speed-up (median): {statistics.median(theirs) / statistics.median(ours):.0f}x")


if __name__ == "__main__":
    main()
