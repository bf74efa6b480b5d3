"""The kernels' build: compiled once into the cache and loaded from there after; a variant the
compiler cannot build is left out and the rest still load; a machine without a compiler, or a
file whose expert type (or a dense matrix's) the kernels do not read, gets one notice and the
float32 numpy path."""
from __future__ import annotations

import logging
import os
import shutil
import stat

import gguf
import numpy as np
import pytest

from moerun.backends.cpu import build
from moerun.backends.cpu.library import CpuKernels, load_kernels
from moerun.backends.numpy_backend import DequantizedExperts, StoredMatrix, expert_store
from moerun.engine.runtime import Runtime
from moerun.gguf.reader import GGUFFile
from moerun.models import load_spec
from tests.support.gguf_edit import rewrite_gguf
from tests.support.hf_models import tiny_model
from tests.support.to_gguf import write_gguf


@pytest.mark.slow
def test_built_once_then_loaded_from_the_cache(kernels, tmp_path, monkeypatch):
    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path))
    first = build.library_path()
    assert first.is_relative_to(tmp_path / "cpu-kernels") and first.name == build.LIBRARY_NAME
    built_at = first.stat().st_mtime_ns
    assert build.library_path() == first and first.stat().st_mtime_ns == built_at
    assert CpuKernels(first).isas() == kernels.isas()


@pytest.mark.slow
def test_a_variant_the_compiler_cannot_build_is_left_out(kernels, tmp_path, monkeypatch):
    best = build.variants()[-1]
    real = shutil.which(build.compiler()[0])
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *{best.source}*) exit 1;; esac\nexec {real} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path / "cache"))
    isas = CpuKernels(build.library_path()).isas()
    assert best.name not in isas and isas[-1] == "scalar"


def test_no_compiler_means_one_notice_and_the_numpy_path(tmp_path, monkeypatch, caplog):
    path = write_gguf(tiny_model("olmoe", seed=2), tmp_path / "model.gguf", "Q8_0")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path / "cache"))
    load_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING), GGUFFile(path) as file:
            stores = [expert_store(file, load_spec(file), 1 << 20) for _ in range(2)]
    finally:
        load_kernels.cache_clear()
    assert all(isinstance(store, DequantizedExperts) for store in stores)
    notices = [r.getMessage() for r in caplog.records if "CPU expert kernels unavailable" in r.getMessage()]
    assert len(notices) == 1 and "no-such-compiler" in notices[0], notices
    assert not os.path.exists(tmp_path / "cache" / "cpu-kernels")


@pytest.mark.slow
def test_an_expert_type_without_kernels_takes_the_numpy_path(kernels, tmp_path, caplog):
    base = write_gguf(tiny_model("qwen3moe", seed=2, hidden_size=256, moe_intermediate_size=256),
                      tmp_path / "model.gguf", "F32")
    rng = np.random.default_rng(0)
    retyped = {}
    for tensor in gguf.GGUFReader(base).tensors:
        if tensor.name == "blk.1.ffn_down_exps.weight":
            n_experts, rows, cols = tensor.data.shape
            blocks = rng.integers(0, 256, (n_experts, rows, cols // 256 * 84), dtype=np.uint8)
            blocks[..., 80:84] = 0                                   # d and dmin: zero weights
            retyped[tensor.name] = (blocks, gguf.GGMLQuantizationType.Q2_K)
    path = rewrite_gguf(base, tmp_path / "q2k.gguf", set_tensors=retyped)
    with caplog.at_level(logging.WARNING), GGUFFile(path) as file:
        store = expert_store(file, load_spec(file), 1 << 20)
    assert isinstance(store, DequantizedExperts)
    assert any("do not read expert tensors of type Q2_K" in r.getMessage() for r in caplog.records)


def test_a_dense_type_without_kernels_is_dequantized_with_one_notice(kernels, tmp_path, caplog):
    base = write_gguf(tiny_model("qwen3moe", seed=2, hidden_size=256), tmp_path / "model.gguf", "F32")
    rng = np.random.default_rng(0)
    retyped = {}
    for tensor in gguf.GGUFReader(base).tensors:
        if tensor.name.endswith("attn_q.weight"):                    # every layer's: Q2_K
            rows, cols = tensor.data.shape
            blocks = rng.integers(0, 256, (rows, cols // 256 * 84), dtype=np.uint8)
            blocks[..., 80:84] = 0
            retyped[tensor.name] = (blocks, gguf.GGMLQuantizationType.Q2_K)
        elif tensor.name.endswith("attn_k.weight"):
            retyped[tensor.name] = (gguf.quants.quantize(np.array(tensor.data), gguf.GGMLQuantizationType.Q8_0),
                                    gguf.GGMLQuantizationType.Q8_0)
    path = rewrite_gguf(base, tmp_path / "q2k.gguf", set_tensors=retyped)
    with caplog.at_level(logging.WARNING), Runtime(path) as runtime:
        layers = runtime.model.weights.layers
        logits = runtime.logits([1, 2, 3])
    assert all(isinstance(layer.attn_q, np.ndarray) and layer.attn_q.dtype == np.float32 for layer in layers)
    assert all(isinstance(layer.attn_k, StoredMatrix) for layer in layers)
    notices = [r.getMessage() for r in caplog.records if "do not read matrices of type Q2_K" in r.getMessage()]
    assert len(notices) == 1 and np.isfinite(logits).all()
