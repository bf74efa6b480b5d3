"""How far quantized activations would move a model's logits: each encoding applied to both
inputs of the routed experts (x, and silu(gate x) · up x before down) inside the float32
reference engine, on the tiny test models of every architecture, against the same engine
unchanged. The numbers behind docs/cpu.md's choice of float32 activations.

    PYTHONPATH=. python scripts/cpu_activation_precision.py      # needs the test extras (torch, transformers)

Prints max |logits - reference| / max |reference| per architecture, file type and encoding.
Shape legend: T tokens, n values per token.
"""
from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

import moerun.backends.numpy_backend as numpy_backend
from moerun.backends.numpy_ops import silu
from moerun.engine.runtime import Runtime
from tests.support.hf_models import ARCHS, tiny_model
from tests.support.to_gguf import write_gguf

PROMPT = np.random.default_rng(0).integers(0, 320, 24).tolist()
Encoding = Callable[[np.ndarray], np.ndarray]      # activations [T, n] -> what they become


def groups(x: np.ndarray, size: int, encode: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """encode() applied to each run of `size` values of every row."""
    out = np.empty_like(x)
    for start in range(0, x.shape[-1], size):
        out[:, start:start + size] = encode(x[:, start:start + size].astype(np.float32))
    return out


def planes(levels: int, second: int, size: int, third: int = 0) -> Encoding:
    """a = rint(x / d) with d = max|x| / levels, then (second > 0) b = rint((x / d - a) · second)
    and (third > 0) c = rint(((x / d - a) · second - b) · third): x ≈ d · (a + (b + c / third) /
    second). levels 127: int8 (llama.cpp: no second plane; the GPU: 254); 32767: int16."""
    def encode(run: np.ndarray) -> np.ndarray:
        amax = np.abs(run).max(axis=1, keepdims=True)
        inverse = np.where(amax > 0, np.float32(levels) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        scaled = run * inverse
        a = np.rint(scaled)
        rest = (scaled - a) * second
        b = np.rint(rest) if second else 0
        c = np.rint((rest - b) * third) / third if third else 0
        return (a + ((b + c) / second if second else 0)) * (amax / np.float32(levels))
    return lambda x: groups(x, size, encode)


ENCODINGS: dict[str, Encoding] = {
    "int8/32 (llama.cpp)": planes(127, 0, 32),
    "2 x int8/32 (GPU)": planes(127, 254, 32),
    "3 x int8/32": planes(127, 254, 32, 254),
    "int16/32": planes(32767, 0, 32),
    "int16/256": planes(32767, 0, 256),
    "int16+int8/256": planes(32767, 254, 256),
}


def logits(path: Path, encode: Encoding | None) -> np.ndarray:
    """The reference engine's logits, its experts' inputs encoded first when `encode` is given."""
    plain = numpy_backend.DequantizedExperts.grouped_ffn

    def encoded(store, layer, x, rows, experts, weights):
        out = np.zeros_like(x)
        for expert in np.unique(experts):
            pick = experts == expert
            gate, up, down = store.get(layer, int(expert))
            inputs = encode(x[rows[pick]])
            h = silu(inputs @ gate.T) * (inputs @ up.T)
            out[rows[pick]] += (encode(h) @ down.T) * weights[pick][:, None]
        return out

    numpy_backend.load_kernels = lambda: None
    numpy_backend.DequantizedExperts.grouped_ffn = plain if encode is None else encoded
    try:
        with Runtime(path) as runtime:
            return runtime.logits(PROMPT)
    finally:
        numpy_backend.DequantizedExperts.grouped_ffn = plain


def main() -> None:
    logging.disable(logging.WARNING)
    folder = Path(tempfile.mkdtemp())
    print(f"{'arch':9} {'file':5} " + " ".join(f"{name:>20}" for name in ENCODINGS))
    for arch in ARCHS:
        for ftype in ("F32", "Q8_0", "Q4_0"):
            path = write_gguf(tiny_model(arch, seed=1), folder / f"{arch}-{ftype}.gguf", ftype)
            reference = logits(path, None)
            errors = [np.max(np.abs(logits(path, encode) - reference)) / np.max(np.abs(reference))
                      for encode in ENCODINGS.values()]
            print(f"{arch:9} {ftype:5} " + " ".join(f"{error:20.1e}" for error in errors), flush=True)


if __name__ == "__main__":
    main()
