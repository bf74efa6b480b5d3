"""moerun's logits against llama.cpp's (llama-cpp-python's CPU build) on the same GGUF file: every
position of one prompt of random token ids, llama.cpp with an f32 KV cache, one thread.

    python scripts/logits_vs_llama_cpp_python.py -m FILE.gguf [--tokens 24]

The file is best F32: llama.cpp multiplies quantized weights with activations quantized to 8 bits,
moerun with float32 ones, so a quantized file's logits differ by that rounding. llama-cpp-python
comes from the venv scripts/bench_vs_llama_cpp_python.py makes (built there once if missing).
Prints max |llama.cpp - moerun| / max |moerun| and the share of positions whose top token agrees.
Shape legend: T tokens, V vocab.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import numpy as np


def llama_side(model: str, ids_path: str, out_path: str) -> None:
    """Runs in the llama-cpp-python venv: logits [T, V] of the ids in ids_path into out_path."""
    import llama_cpp

    ids = np.load(ids_path).tolist()
    f32 = 0                                          # GGML_TYPE_F32, for the KV cache
    llm = llama_cpp.Llama(model_path=model, n_ctx=len(ids) + 8, n_batch=len(ids), n_ubatch=len(ids),
                          logits_all=True, n_threads=1, type_k=f32, type_v=f32, verbose=False)
    llm.eval(ids)
    np.save(out_path, np.array(llm.scores[:len(ids)], np.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--venv", default=str(Path.home() / ".cache" / "moerun" / "llama-cpp-python"))
    parser.add_argument("--llama-version", default="0.3.36")
    parser.add_argument("--llama-side", nargs=2, metavar=("IDS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_side:
        llama_side(args.model, *args.llama_side)
        return

    from bench_vs_llama_cpp_python import llama_python

    from moerun.engine.runtime import Runtime

    with Runtime(args.model) as runtime:
        ids = np.random.default_rng(0).integers(0, runtime.spec.vocab, args.tokens)
        ours = runtime.logits(ids.tolist())
    with tempfile.TemporaryDirectory() as folder:
        ids_path, out_path = Path(folder) / "ids.npy", Path(folder) / "logits.npy"
        np.save(ids_path, ids)
        python = llama_python(Path(args.venv), args.llama_version)
        subprocess.run([python, __file__, "-m", args.model, "--llama-side", ids_path, out_path], check=True)
        theirs = np.load(out_path)
    error = np.max(np.abs(theirs - ours)) / np.max(np.abs(ours))
    agree = float(np.mean(theirs.argmax(-1) == ours.argmax(-1)))
    print(f"{args.model}: {args.tokens} positions, max |llama.cpp - moerun| / max |moerun| = {error:.2e}, "
          f"top token agrees at {agree:.0%} of them")


if __name__ == "__main__":
    main()
