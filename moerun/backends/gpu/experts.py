"""Routed experts on the GPU, resident in their stored type: every expert of every layer, or
the ones a placement gave this process (a parent's hot ones, a GPU daemon's).

A few tokens (decode): two launches per layer for all selected experts — gate and
up with SwiGLU per (token, expert) pair, then down with the weighted sum over the
token's experts (quantized experts: activations in 8-bit planes, integer dot products).
Many tokens (prefill): the pairs laid out by expert in tiles of rows on the device, each
tile multiplied by its expert's weights dequantized stage by stage in shared memory (f16
operands, f32 accumulation; each expert read in its stored type once per tile), the
results gathered back with their weights — no host round trip, however skewed the routing.

Shape legend: T tokens, H hidden, F expert FFN width, E experts, K experts per
token, P = T*K routed pairs, R rows of the tiles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moerun.backends.gpu.constants import MAX_EXPERTS, MAX_GEMV_TOKENS, MAX_TOP_K, UNIT
from moerun.backends.gpu.library import (
    BLOCK,
    FULL_OCCUPANCY_BYTES,
    INT_KINDS,
    UNITS_PER_LANE,
    pointer,
    row_group,
    stage_stride,
)
from moerun.backends.gpu.weights import DeviceMatrix, Uploader
from moerun.errors import UsageError
from moerun.models.spec import ModelSpec

DOWN_WARPS = 8                # most warps of the quantized down kernel (one per expert slot)
LONG_DOWN_UNITS = 256         # down rows of at least this many units: 4 rows per group of a whole warp
TILE_SHAPES = {32: (64, 4), 64: (64, 4), 128: (64, 8)}   # rows per tile of an expert's tokens -> output
                                                         # columns and warps of a block (TileShape in moe_mm.cu)


@dataclass
class LayerExperts:
    gate_up: DeviceMatrix     # the stack holding gate (and up after it when fused), [E, F or 2F, H]
    up_stack: DeviceMatrix    # the stack holding up: gate_up itself when fused
    up_first_row: int         # where up starts in each expert of up_stack: F when fused, else 0
    down: DeviceMatrix        # [E, H, F]

    @property
    def up(self) -> Any:
        """Device bytes of expert 0's up rows; expert e at + e * expert_bytes."""
        return self.up_stack.data[self.up_first_row * self.up_stack.row_bytes:]

    @property
    def stacks(self) -> list[DeviceMatrix]:
        """One stack per GGUF tensor, in spec.expert_tensor_names order."""
        if self.up_stack is self.gate_up:
            return [self.gate_up, self.down]
        return [self.gate_up, self.up_stack, self.down]

    @property
    def n_experts(self) -> int:
        return self.down.experts


def layer_experts(stacks: list[DeviceMatrix], ffn: int) -> LayerExperts:
    """LayerExperts over one stack per GGUF tensor: [gate_up, down] (fused) or [gate, up, down]."""
    if len(stacks) == 2:
        gate_up, down = stacks
        return LayerExperts(gate_up, gate_up, ffn, down)
    gate, up, down = stacks
    return LayerExperts(gate, up, 0, down)


def with_room(cupy, experts: LayerExperts, extra: int) -> LayerExperts:
    """A copy of `experts` whose stacks hold `extra` more experts after the ones held (room for
    experts copied in later), the held ones in their places."""
    grown = []
    for stack in experts.stacks:
        data = cupy.empty((stack.experts + extra) * stack.expert_bytes, cupy.uint8)
        data[:stack.data.size] = stack.data
        grown.append(DeviceMatrix(data, stack.kind, stack.rows, stack.cols, stack.experts + extra))
    return layer_experts(grown, experts.up_first_row)


class GpuExperts:
    """Routed experts on the device, by layer; ids are local ids (the position among the
    experts held of that layer, -1: none)."""

    def __init__(self, backend, spec: ModelSpec, layers: dict[int, LayerExperts]):
        if spec.n_experts_used > MAX_TOP_K:
            raise UsageError(f"the GPU experts sum at most {MAX_TOP_K} experts per token "
                             f"(this model routes {spec.n_experts_used})")
        self.backend = backend
        self.spec = spec
        self.layers = layers

    def compute(self, layer: int, x: Any, ids: Any, weights: Any, out: Any | None = None,
                residual: Any | None = None) -> Any:
        """x [T, H], ids/weights [T, K] on the device -> [T, H] (plus `residual` [T, H], added by the
        kernel that writes the output), queued on the stream now; written into `out` when given (a
        daemon's reply buffer)."""
        return self.compute_with(self.layers[layer], x, ids, weights, out, residual)

    def compute_through(self, experts: LayerExperts, table: Any, found: Any, x: Any, ids: Any, weights: Any,
                        residual: Any | None) -> Any:
        """As compute_with for global ids [T, K] mapped through table [E] to positions in `experts`
        (-1: not there), counting the pairs found into the device counter `found`."""
        mapped = self.backend.device.cupy.empty_like(ids)
        self.backend.device.launch("map_ids", (1,), (BLOCK,), (ids, np.int32(ids.size), table, mapped, found))
        return self.compute_with(experts, x, mapped, weights, residual=residual)

    def compute_with(self, experts: LayerExperts, x: Any, ids: Any, weights: Any, out: Any | None = None,
                     residual: Any | None = None) -> Any:
        """As compute, over the stacks `experts` (ids: positions in them)."""
        if ids.shape[0] <= MAX_GEMV_TOKENS:
            return self._few_tokens(experts, x, ids, weights, out, residual)
        return self._grouped(experts, x, ids, weights, out, residual)

    def _few_tokens(self, experts: LayerExperts, x: Any, ids: Any, weights: Any, out: Any | None,
                    residual: Any | None) -> Any:
        """Quantized experts: gate/up with SwiGLU per pair writing the activations in 8-bit planes,
        then down per token over its experts, integer dot products throughout. Float experts
        (F32, F16, BF16): the same two steps in f32."""
        backend, spec = self.backend, self.spec
        cupy, kernels = backend.device.cupy, backend.device.kernels
        n_tokens, top_k = ids.shape
        hidden, ffn = spec.hidden, experts.down.cols
        stack, down = experts.gate_up, experts.down
        out = cupy.empty((n_tokens, hidden), cupy.float32) if out is None else out    # [T, H]
        if stack.kind in INT_KINDS and down.kind in INT_KINDS:
            xq, xds = backend.q8_of(x)
            aq = cupy.empty((n_tokens * top_k, 2 * ffn), cupy.int8)                 # [P, 2F]
            ads = cupy.empty((n_tokens * top_k, ffn // UNIT, 2), cupy.float32)
            gate_up_rows, gate_up_group = decode_gate_up_shape(hidden, ffn)
            kernels.launch(f"moe_gate_up_q8_{stack.kind}_r{gate_up_rows}", (ffn // UNIT, n_tokens * top_k),
                           (UNIT * gate_up_group // gate_up_rows,), (
                stack.data, experts.up, np.int64(stack.expert_bytes), np.int64(stack.row_bytes), xq, xds,
                np.int32(hidden), ids, np.int32(top_k), aq, ads, np.int32(ffn), np.int32(gate_up_group)))
            (group, rows), warps = decode_down_rows(ffn // UNIT, top_k), min(top_k, DOWN_WARPS)
            # a warp's rows of one expert, staged only where the slots leave every thread resident:
            # Mixtral's rows (14336 values) would hold 9 blocks of 2 warps a multiprocessor
            stride = stage_stride(32 // group * rows * down.row_bytes, warps, 32 * warps * FULL_OCCUPANCY_BYTES)
            kernels.launch(
                f"moe_down_q8_{down.kind}_r{rows}",
                (-(-hidden * group // (32 * rows)), n_tokens), (32 * warps,),
                (down.data, np.int64(down.expert_bytes), np.int64(down.row_bytes), aq, ads, np.int32(ffn),
                 ids, weights, np.int32(top_k), out, pointer(residual), np.int32(hidden), np.int32(stride),
                 np.int32(group)),
                stride * warps)
            return out
        act = cupy.empty((n_tokens * top_k, ffn), cupy.float32)                      # [P, F]
        kernels.rows(f"moe_gate_up_{stack.kind}", ffn, hidden // UNIT, n_tokens * top_k,
                     (stack.data, experts.up, np.int64(stack.expert_bytes), np.int64(stack.row_bytes),
                      x, np.int32(hidden), ids, np.int32(top_k), act, np.int32(ffn)))
        kernels.rows(f"moe_down_{down.kind}", hidden, ffn // UNIT, n_tokens,
                     (down.data, np.int64(down.expert_bytes), np.int64(down.row_bytes), act, np.int32(ffn),
                      ids, weights, np.int32(top_k), out, np.int32(hidden), pointer(residual)))
        return out

    def _grouped(self, experts: LayerExperts, x: Any, ids: Any, weights: Any, out: Any | None,
                 residual: Any | None) -> Any:
        """Pairs laid out expert by expert in tiles on the device (no host round trip), gate/up
        with SwiGLU and then down straight from the stored blocks, tile by tile, then the
        weighted sum back per token."""
        backend, spec = self.backend, self.spec
        cupy, kernels = backend.device.cupy, backend.device.kernels
        n_tokens, top_k = ids.shape
        hidden, ffn = spec.hidden, experts.down.cols
        stack, down = experts.gate_up, experts.down
        rows = tile_rows(ids.size, down.experts)
        columns, warps = TILE_SHAPES[rows]
        layout = TileLayout(backend, ids, down.experts, rows)
        xg = cupy.empty((layout.max_rows, hidden), cupy.float16)                     # [R, H]
        kernels.elementwise("gather_rows_f16", xg.size // 8, (x, layout.token_rows, np.int32(hidden),
                                                              np.int64(layout.max_rows), xg))
        act = cupy.empty((layout.max_rows, ffn), cupy.float16)                       # [R, F]
        kernels.launch(f"moe_mm_gate_up_{stack.kind}_r{rows}", (-(-ffn // columns), layout.max_tiles), (32 * warps,), (
            stack.data, experts.up, np.int64(stack.expert_bytes), np.int64(stack.row_bytes), xg, np.int32(hidden),
            layout.tile_expert, layout.tile_row, np.int32(ffn), act))
        rows_out = cupy.empty((layout.max_rows, hidden), cupy.float32)               # [R, H]
        kernels.launch(f"moe_mm_down_{down.kind}_r{rows}", (-(-hidden // columns), layout.max_tiles), (32 * warps,), (
            down.data, np.int64(down.expert_bytes), np.int64(down.row_bytes), act, np.int32(ffn),
            layout.tile_expert, layout.tile_row, np.int32(hidden), rows_out))
        out = cupy.empty((n_tokens, hidden), cupy.float32) if out is None else out
        kernels.elementwise("combine_rows", out.size, (rows_out, layout.pair_rows, weights, np.int32(top_k),
                                                       np.int32(hidden), np.int64(n_tokens), pointer(residual),
                                                       out))
        return out


def load_experts(uploader: Uploader, spec: ModelSpec, layer: int, experts: list[int] | None = None) -> LayerExperts:
    """One layer's expert stacks: every expert, or only `experts` (stacked in that order)."""
    stacks = [uploader.matrix(name, experts) for name in spec.expert_tensor_names(layer)]
    if not spec.fused_gate_up and stacks[0].kind != stacks[1].kind:
        raise UsageError(f"layer {layer}: expert gate ({stacks[0].kind}) and up ({stacks[1].kind}) tensors of "
                         "different types are not supported on the GPU")
    return layer_experts(stacks, spec.expert_ff)


def tile_rows(n_pairs: int, n_experts: int) -> int:
    """Rows per tile for n_pairs routed pairs over n_experts: the largest tile an expert of
    average load fills at least three quarters of. A tile's weights are dequantized once for
    all of its rows, so Mixtral's 8 experts (~128 pairs each in a 512-token chunk) take tiles
    of 128, Qwen3's 128 experts (~32 each) tiles of 32."""
    per_expert = n_pairs / max(n_experts, 1)
    return max([rows for rows in TILE_SHAPES if 4 * per_expert >= 3 * rows], default=min(TILE_SHAPES))


class TileLayout:
    """The routed pairs ids [T, K] laid out on the device: expert e owns whole tiles of
    `rows` rows; row r holds token token_rows[r] (-1: padding); pair p sits in row
    pair_rows[p]. At most max_tiles tiles: one per `rows` pairs, plus one partial tile
    per expert; tiles past the last have expert -1."""

    def __init__(self, backend, ids: Any, n_experts: int, rows: int):
        cupy = backend.device.cupy
        if n_experts > MAX_EXPERTS:
            raise UsageError(f"the GPU prefill lays out at most {MAX_EXPERTS} experts per layer (got {n_experts})")
        n_pairs = ids.size
        self.max_tiles = -(-n_pairs // rows) + n_experts
        self.max_rows = self.max_tiles * rows
        self.counts = cupy.empty(n_experts, cupy.int32)                               # [E]
        self.tile_expert = cupy.empty(self.max_tiles, cupy.int32)
        self.tile_row = cupy.empty(self.max_tiles, cupy.int32)
        self.token_rows = cupy.empty(self.max_rows, cupy.int32)                       # [R]
        self.pair_rows = cupy.empty(n_pairs, cupy.int32)                              # [P]
        backend.device.launch("layout_pairs", (1,), (1024,), (
            ids, np.int32(n_pairs), np.int32(ids.shape[1]), np.int32(n_experts), np.int32(rows),
            np.int32(self.max_tiles), np.int32(self.max_rows), self.counts, self.tile_expert, self.tile_row,
            self.token_rows, self.pair_rows))


def decode_gate_up_shape(hidden: int, ffn: int) -> tuple[int, int]:
    """(rows of gate and of up each group of the quantized gate/up kernel takes, threads a group;
    32 rows a block): two rows to groups of 8 where hidden has 96 units or more (3072+) and the
    experts are long (ffn of LONG_DOWN_UNITS units or more: Mixtral's 14336, Qwen2-57B's shared
    expert), so that more weight loads are in flight and each unit of x serves four rows
    (Mixtral's gate/up 64.9 -> 55.9 us with 8 threads in place of 16 on the H100); else one row to
    16 threads (Qwen3-30B's hidden 2048, and Qwen3-235B's short experts at 4096: tg128 1432 ->
    1361 t/s on an H100 with two rows)."""
    return (2, 8) if hidden // UNIT >= 96 and ffn // UNIT >= LONG_DOWN_UNITS else (1, 16)


def decode_down_rows(units: int, top_k: int) -> tuple[int, int]:
    """(threads sharing a row, rows per group) of the quantized down kernel for rows of `units`
    units of 32 and `top_k` experts a token (a warp each): a unit of act serves two rows (four
    for rows of LONG_DOWN_UNITS and more, a whole warp on each, where a block has two warps or
    more: Mixtral's 14336; a one-expert down of such rows, a shared expert's, 48.4 -> 39.3 us
    with two), 1.1-1.35x over one row on every preset's shape (docs/benchmarks.md); at most 16
    threads a row otherwise, each with two units or more."""
    if units >= LONG_DOWN_UNITS:
        return 32, 4 if top_k >= 2 else 2
    group = min(row_group(units, UNITS_PER_LANE), 16)
    return group, min(2, group)
