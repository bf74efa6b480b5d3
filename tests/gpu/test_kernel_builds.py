"""The one kernel source tree compiles for AMD GPUs with hipcc (gfx906 and gfx1030,
compile only) and for NVIDIA Hopper with nvcc, and defines every kernel the
backend launches for each stored type."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from moerun.backends.gpu.backend import DECODE_HEAD_TILES, DECODE_LANE_DIMS
from moerun.backends.gpu.constants import defines
from moerun.backends.gpu.experts import TILE_SHAPES
from moerun.backends.gpu.library import INT_KINDS, KERNEL_DIR
from moerun.backends.gpu.weights import KERNEL_TYPES
from moerun.backends.kv_types import GPU_KV_TYPES

pytestmark = [pytest.mark.tools, pytest.mark.slow]   # a compile takes ~15 s
PER_TYPE = ("moe_gate_up", "moe_down", "dequant_f16", "gather_rows_f32")
PER_TYPE_AND_TILE = ("moe_mm_gate_up", "moe_mm_down")
PER_FLOAT_TYPE = ("gemv", "gemv_few_rows")
PER_INT_TYPE = ("gemv_q8", "gemv_q8_one")
PER_INT_TYPE_AND_ROWS = {"moe_gate_up_q8": (1, 2), "moe_down_q8": (1, 2, 4)}   # rows a group (experts.py)
PER_KV_TYPE = ("qk_norm_rope_append", "attention_partial", "expand_kv_heads")
SHARED = ("quantize_q8", "gemv_q8_three", "gemv_q8_three_one", "rms_norm", "attention_combine", "route_top_k",
          "silu_mul", "gather_rows_f16", "combine_rows", "add_gated", "to_f16",
          "causal_softmax_block", "attention_divide", "layout_pairs", "split_parent_ids", "map_ids", "pack_remote",
          "unpack_payload", "add_reply_rows", "delta_conv", "delta_conv_state", "delta_prepare", "delta_rule",
          "delta_gate_norm", "sigmoid_gate")


def compiler_leftovers() -> set[Path]:
    """hipcc's moerun-XXXXXX folders in /tmp (six characters after the input's name: not the
    moerun-run-* and moerun-ipc-* folders that moerun processes and tests beside it make)."""
    return {path for path in Path(tempfile.gettempdir()).glob("moerun-*")
            if re.fullmatch(r"moerun-[A-Za-z0-9]{6}", path.name)}


def compile_kernels(command: list[str], output: Path, env: dict | None = None) -> bytes:
    """Compile with the compiler's scratch files in a folder of the test's own: hipcc leaves
    empty moerun-XXXXXX folders in its temporary directory."""
    scratch = output.parent / "scratch"
    scratch.mkdir()
    before = compiler_leftovers()
    result = subprocess.run([*command, *defines(), "-c", str(KERNEL_DIR / "moerun.cu"), "-o", str(output)],
                            capture_output=True, text=True, timeout=900,
                            env={**(env or os.environ), "TMPDIR": str(scratch)})
    assert compiler_leftovers() <= before, "the compile left files in /tmp"
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [line for line in result.stderr.splitlines() if "warning" in line], result.stderr[-3000:]
    return output.read_bytes()


def assert_defines_every_kernel(binary: bytes) -> None:
    float_kinds = [kind for kind in KERNEL_TYPES.values() if kind not in INT_KINDS]
    names = ([f"{family}_{kind}" for family in PER_TYPE for kind in KERNEL_TYPES.values()]
             + [f"{family}_{kind}_r{rows}" for family in PER_TYPE_AND_TILE for kind in KERNEL_TYPES.values()
                for rows in TILE_SHAPES]
             + [f"{family}_{kind}" for family in PER_FLOAT_TYPE for kind in float_kinds]
             + [f"{family}_{kind}" for family in PER_INT_TYPE for kind in INT_KINDS]
             + [f"{family}_{kind}_r{rows}" for family, all_rows in PER_INT_TYPE_AND_ROWS.items() for kind in INT_KINDS
                for rows in all_rows]
             + [f"{family}_{kind}" for family in PER_KV_TYPE for kind in GPU_KV_TYPES] + list(SHARED)
             + [f"attention_decode_{kind}_{tile}_{dims}" for kind in GPU_KV_TYPES for tile in DECODE_HEAD_TILES
                for dims in DECODE_LANE_DIMS if (tile, dims) != (8, 8)])
    missing = [name for name in names if name.encode() not in binary]
    assert not missing


@pytest.mark.skipif(shutil.which("hipcc") is None, reason="hipcc is not installed (scripts/test.sh installs it)")
@pytest.mark.parametrize("arch", ["gfx906", "gfx1030"])
def test_kernels_compile_for_amd(tmp_path, arch):
    env = {**os.environ, "HIP_PLATFORM": "amd"}
    binary = compile_kernels(["hipcc", f"--offload-arch={arch}", "--cuda-device-only", "-O3", "-std=c++17"],
                             tmp_path / "k.o", env)
    assert_defines_every_kernel(binary)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_kernels_compile_for_hopper(tmp_path):
    binary = compile_kernels(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin"], tmp_path / "k.cubin")
    assert_defines_every_kernel(binary)


def kernel_bodies() -> dict[str, str]:
    """Each kernel's name (macro names keep their ## part) -> the start of its body."""
    bodies = {}
    for path in KERNEL_DIR.glob("*.cu"):
        source = path.read_text().replace("\\\n", "\n")
        for match in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?([\w#]+)\(", source):
            depth, at = 1, match.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(source[at], 0)
                at += 1
            bodies[f"{path.name}:{match.group(1)}"] = source[source.index("{", at) + 1:].lstrip()
    return bodies


# These read weights, which no kernel writes, before they wait (staging.cuh; the down experts'
# ids too, written two launches before; rope and attention the step's positions, written before
# its first kernel, and attention fetches earlier steps' cache rows into L2).
READ_BEFORE_WAIT = {"layers.cu:rms_norm", "gemv_q8.cu:NAME##_##TYPE", "gemv_q8.cu:NAME",
                    "gemv_q8.cu:moe_down_q8_##TYPE##_r##R", "gemv.cu:gemv_few_rows_##TYPE",
                    "route.cu:route_normed_##TYPE", "attention.cu:qk_norm_rope_append_##KV",
                    "attention.cu:attention_partial_##KV", "attention.cu:attention_decode_##KV##_##TILE##_##DPL"}


def test_every_kernel_first_waits_for_the_previous_grid():
    """Kernels go out as programmatic dependent launches on Hopper: one that read or wrote
    anything before waiting would race the kernel before it."""
    bodies = kernel_bodies()
    assert len(bodies) >= 29
    late = [name for name, body in bodies.items()
            if not body.startswith("wait_for_previous_grid();") and name not in READ_BEFORE_WAIT]
    assert not late
    assert all("wait_for_previous_grid();" in bodies[name] for name in READ_BEFORE_WAIT)
