"""The GPU backend (CUDA through CuPy, HIP through CuPy for ROCm): weights stay in
their stored types on the device and every operation is a kernel of kernels/.

Decode (T <= 8) multiplies quantized weights by activations converted once per input
to two 8-bit planes (integer dot products, kernels/q8_dot.cuh) and float weights in f32.
Prefill dequantizes each dense matrix to f16 and multiplies on the matrix units with f32
accumulation and output (f32 matrices, the routers, stay f32); the experts multiply
straight from their stored blocks (experts.py, kernels/moe_mm.cu); attention is
batched TF32 products over a KV cache of f16 (by default, as llama.cpp's) or f32. Decode
steps replay as captured CUDA graphs (with daemons: graph segments between the MoE layers'
host actions; not on HIP, or with graphs off).
Shape legend: T tokens, H hidden, N output rows, NH/NKV heads, D/Dv head dims,
E experts, K experts per token, S cache positions.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from moerun.backends.devices import Device
from moerun.backends.gpu.blas import Blas
from moerun.backends.gpu.constants import (
    ATTENTION_THREADS,
    DELTA_COLUMNS,
    DELTA_GROUPS,
    MAX_CONV_WIDTH,
    MAX_EXPERTS,
    MAX_GEMV_TOKENS,
    MAX_KEY_DIM,
    MAX_TOP_K,
    NORM_VALUES,
    ROUTE_VALUES,
    UNIT,
)
from moerun.backends.gpu.device import GpuDevice
from moerun.backends.gpu.experts import GpuExperts, LayerExperts, load_experts
from moerun.backends.gpu.graphs import GraphCache
from moerun.backends.gpu.library import (
    BLOCK,
    INT_KINDS,
    NULL,
    ONE_TOKEN_BLOCK,
    ONE_TOKEN_UNITS_PER_LANE,
    UNITS_PER_LANE,
    pointer,
    stage_stride,
)
from moerun.backends.gpu.weights import DeviceMatrix, Uploader
from moerun.backends.kv_types import KVTypes, check_gpu_kv_types
from moerun.backends.numpy_ops import rope_frequencies
from moerun.backends.progress import UploadProgress
from moerun.backends.protocol import CacheState, ContextFull, Forward, RecurrentStates, swiglu_by_products
from moerun.errors import UsageError
from moerun.gguf.reader import GGUFFile
from moerun.models.spec import ModelSpec

NORM_BLOCK = 1024              # threads per row of rms_norm
FEW_ROWS = 512                 # a float matrix of at most this many rows (a router) gets a block per row
FEW_ROWS_THREADS = 64          # threads of each of those blocks
ROUTE_THREADS = 128            # threads of each block of route_normed (a router row; the last ranks the experts) ...
NORMED_VALUES = 8              # values of a row each thread converts when q/k/v fold the norm (q8_dot.cuh) ...
NORMED_PLANES_LIMIT = 24 * 1024     # ... into at most this much shared memory of 8-bit planes
DECODE_CHUNK = 64              # decode attention takes at most one split per this many cache positions ...
MAX_DECODE_SPLITS = 64         # ... and at most this many per row of blocks
DECODE_LANE_DIMS = (2, 4, 8)   # a decode attention lane's dims of a row (kernels/attention.cu instantiates each)
DECODE_HEAD_TILES = (1, 4, 8)  # query heads of a decode attention block (the same)
PREFILL_KEY_BLOCK = 4096       # cache positions a prefill chunk's attention takes a pass (its scratch is bounded)
GROUPED_ATTENTION_SPAN = 8192   # steps past this many positions decode with the grouped kernel, others a block
                                # per head (a captured step's key tells the two apart)


def i32(value: int) -> np.int32:
    return np.int32(value)


def i64(value: int) -> np.int64:
    return np.int64(value)


def attention_splits(span: int, heads: int, wave: int) -> int:
    """Splits per row of blocks of decode attention over `span` cache positions, for `heads`
    (T·NKV·tiles) rows of blocks: as many as one wave of resident blocks (`wave`) holds, at most
    one per DECODE_CHUNK positions and MAX_DECODE_SPLITS in all (the combine reads every split of
    a head), at least one. A long position needs every block the GPU holds at once to keep its
    memory busy, and a second wave would add a whole block's latency; a split past the token's
    position costs one block that reads the position and writes (-inf, 0)."""
    return max(1, min(wave // heads, math.ceil(span / DECODE_CHUNK), MAX_DECODE_SPLITS))


def decode_attention_kernel(n_heads: int, n_kv_heads: int, head_dim_k: int, head_dim_v: int) -> tuple[int, int]:
    """(head tile, dims per lane) of attention_decode_<KV>_<TILE>_<DPL> (kernels/attention.cu) for a
    head layout: a lane holds DPL of a row's dims (32·DPL >= the wider head, both heads whole
    multiples of DPL), a block TILE query heads of one KV head's group (8 but with 8 dims, whose
    registers spill, then 4; 4 for groups of 2 to 4; 1 for MHA)."""
    widest = max(head_dim_k, head_dim_v)
    dims = next((n for n in DECODE_LANE_DIMS if 32 * n >= widest), None)
    if dims is None or head_dim_k % dims or head_dim_v % dims or n_heads % n_kv_heads:
        raise UsageError(f"heads of {head_dim_k}/{head_dim_v} dims, {n_heads} query and {n_kv_heads} KV heads: "
                         f"the GPU's decode attention takes head dims of at most {32 * DECODE_LANE_DIMS[-1]}, "
                         f"whole multiples of {dims or DECODE_LANE_DIMS[-1]}, and query heads a multiple of KV heads")
    group = n_heads // n_kv_heads
    tile = 1 if group == 1 else 4 if group <= 4 or dims == 8 else 8
    return tile, dims


class GpuKVCache:
    """Keys and values of one sequence in buffers sized for the whole capacity, so a
    captured decode step keeps pointing at the same memory; a DeltaNet layer's states instead
    (conv [W-1, C], ssm [HV, DK, DV], f32), zeroed for each new sequence."""

    def __init__(self, buffers: tuple[list, list, dict, dict], capacity: int, stream, pinned):
        self.k, self.v, self.conv, self.ssm = buffers   # per layer: [S, NKV, D], [S, NKV, Dv] of f16 or f32
        self.capacity = capacity
        self.length = 0
        self.stream = stream                  # the backend's: what writes the buffers
        self.pinned = pinned                  # (shape, dtype) -> a page-locked numpy array
        for state in (*self.conv.values(), *self.ssm.values()):
            state.fill(0)

    def reserve(self, n_tokens: int) -> None:
        if self.length + n_tokens > self.capacity:
            raise ContextFull(self.length + n_tokens, self.capacity)

    def advance(self, n_tokens: int) -> None:
        self.length += n_tokens

    def truncate(self, length: int) -> None:
        """Keep positions 0..length-1 of the attention layers, as PagedKVCache.truncate."""
        self.length = min(self.length, length)

    def recurrent_states(self) -> RecurrentStates:
        """Device copies, queued on the backend's stream (what writes the states)."""
        with self.stream:
            return RecurrentStates({i: a.copy() for i, a in self.conv.items()},
                                   {i: a.copy() for i, a in self.ssm.items()})

    def restore_recurrent(self, states: RecurrentStates) -> None:
        """In place (captured steps keep pointing at the same buffers), on the backend's stream."""
        with self.stream:
            for mine, saved in ((self.conv, states.conv), (self.ssm, states.ssm)):
                for layer, state in saved.items():
                    mine[layer][...] = state

    def snapshot(self) -> CacheState:
        """Into page-locked arrays (CuPy's pool keeps the memory of dropped ones for the next),
        every copy queued before the one wait."""
        end = self.length
        attention = [i for i in range(len(self.k)) if i not in self.conv]

        def host(array):
            out = self.pinned(array.shape, array.dtype)
            array.get(stream=self.stream, out=out, blocking=False)
            return out

        state = CacheState(end, keys={i: host(self.k[i][:end]) for i in attention},
                           values={i: host(self.v[i][:end]) for i in attention},
                           conv={i: host(a) for i, a in self.conv.items()},
                           ssm={i: host(a) for i, a in self.ssm.items()})
        self.stream.synchronize()
        return state

    def restore(self, state: CacheState) -> None:
        """Hold `state` (of a cache of this model and element type) from position 0: from
        page-locked arrays (snapshot()'s) the copies are all queued before the one wait."""
        self.reserve(state.length)
        for layer, keys in state.keys.items():
            self.k[layer][:state.length].set(keys, stream=self.stream)
            self.v[layer][:state.length].set(state.values[layer], stream=self.stream)
        for layer, conv in state.conv.items():
            self.conv[layer].set(conv, stream=self.stream)
            self.ssm[layer].set(state.ssm[layer], stream=self.stream)
        self.stream.synchronize()
        self.length = state.length


class GpuBackend:
    def __init__(self, device: Device, spec: ModelSpec, graphs: bool = True,
                 kv_types: KVTypes = KVTypes("f16", "f16")):
        check_gpu_kv_types(kv_types)
        shape = spec.delta_net
        if shape is not None and not (shape.key_dim <= MAX_KEY_DIM and shape.value_dim <= 1024
                                      and shape.conv_kernel <= MAX_CONV_WIDTH):
            raise UsageError(f"{spec.rule.gguf_arch}: the GPU's DeltaNet kernels take key heads of at most "
                             f"{MAX_KEY_DIM} dims, value heads of at most 1024 and convolutions of at most "
                             f"{MAX_CONV_WIDTH} (this model: {shape})")
        self.device = GpuDevice(device)       # the stream, launches, copies, capture state, the rig's hooks
        cupy = self.device.cupy
        self.name = device.name
        self.kind = device.platform.upper()
        self.spec = spec
        self.kv_types = kv_types
        self.kv_dtype = kv_dtype = kv_types.key           # the kernels' element type, f16 or f32
        tile, dims = decode_attention_kernel(spec.n_heads, spec.n_kv_heads, spec.head_dim_k, spec.head_dim_v)
        tiles = -(-(spec.n_heads // spec.n_kv_heads) // tile)
        # decode attention's kernels and their rows of blocks: a tile of a KV head's heads, or a head
        self._grouped_attention = (f"attention_decode_{kv_dtype}_{tile}_{dims}", spec.n_kv_heads * tiles)
        self._per_head_attention = (f"attention_partial_{kv_dtype}", spec.n_heads)
        if spec.hidden > NORM_BLOCK * NORM_VALUES:
            raise UsageError(f"hidden size {spec.hidden}: the GPU backend normalises rows of at most "
                             f"{NORM_BLOCK * NORM_VALUES} values")
        self.blas = Blas(cupy)
        self.graphs_enabled = graphs and not cupy.cuda.runtime.is_hip
        self._graphs = GraphCache(self, MAX_GEMV_TOKENS)
        self._kv_buffers: dict[int, tuple[list, list]] = {}
        self._uploader: Uploader | None = None
        self._last_f16: tuple[Any, Any] = (None, None)        # (activations, their f16 copy)
        self._last_q8: tuple[Any, Any] = (None, None)         # (activations, their 8-bit planes)
        self.inv_freq = cupy.asarray(rope_frequencies(spec.rotary_dims, spec.rope_base))
        self._route_done = cupy.zeros(1, cupy.uint32)        # route_normed's count of finished blocks
        if spec.n_experts > MAX_EXPERTS or spec.n_experts_used > MAX_TOP_K:
            raise UsageError(f"{spec.n_experts} experts, {spec.n_experts_used} per token: the GPU backend routes "
                             f"at most {MAX_EXPERTS} experts, {MAX_TOP_K} per token")
        # one token's SwiGLU FFN as a stack of one expert through the routed experts' kernels: its
        # id and weight
        self._one_expert = GpuExperts(self, spec, {})
        self._expert_zero, self._weight_one = cupy.zeros((1, 1), cupy.int32), cupy.ones((1, 1), cupy.float32)

    # -- loading
    def begin_loading(self, gguf: GGUFFile) -> None:
        self._progress = UploadProgress(sum(info.nbytes for info in gguf.tensors.values()), self.name)
        self._uploader = Uploader(self.device.cupy, gguf, self._progress.advance)

    def finish_loading(self) -> None:
        try:
            self._uploader.finish()
        finally:
            self._progress.close()
            self._uploader = None

    def matrix(self, gguf: GGUFFile, name: str) -> DeviceMatrix:
        return self._uploader.matrix(name)

    def embedding(self, gguf: GGUFFile, name: str) -> DeviceMatrix:
        """In mapped host memory: a step gathers T rows of it (no device memory for the table)."""
        return self._uploader.host_matrix(name, self.device.index)

    def vector(self, values: np.ndarray) -> Any:
        return self.device.cupy.asarray(np.ascontiguousarray(values, dtype=np.float32))

    def load_experts(self, gguf: GGUFFile, held: dict[int, list[int]] | None, cache_bytes: int) -> GpuExperts:
        """Every expert, or the `held` ones per layer (a parent with daemons: its hot ones)."""
        layers = {}
        for layer, is_moe in enumerate(self.spec.moe_layers):
            ids = None if held is None else held.get(layer, [])
            if is_moe and (ids is None or ids):
                layers[layer] = load_experts(self._uploader, self.spec, layer, ids)
        return GpuExperts(self, self.spec, layers)

    # -- buffers
    def upload_ids(self, ids: np.ndarray) -> Any:
        return self.device.cupy.asarray(np.asarray(ids, dtype=np.int32))

    def positions(self, start: int, n_tokens: int) -> Any:
        return self.device.cupy.arange(start, start + n_tokens, dtype=self.device.cupy.int32)

    def to_host(self, x: Any) -> np.ndarray:
        """x in page-locked host memory (from CuPy's pool): a step's logits come back several
        times faster than through a pageable copy."""
        out = self.device.pinned(x.shape, x.dtype)
        self.device.cupy.ascontiguousarray(x).get(stream=self.device.stream, out=out)
        return out

    cache_grows = False

    def context_memory(self, ubatch: int) -> tuple[int, int]:
        """The device's free memory, with what CuPy's pool holds free, less a prefill chunk's
        attention scratch, which one block of positions bounds (_prefill_attention: scores [NH, T,
        B] and the block's keys and values expanded per query head [NH, B, D + Dv], f32)."""
        spec, cupy = self.spec, self.device.cupy
        with cupy.cuda.Device(self.device.index):
            free, _ = cupy.cuda.runtime.memGetInfo()
        scratch = 4 * spec.n_heads * PREFILL_KEY_BLOCK * (ubatch + spec.head_dim_k + spec.head_dim_v)
        return free + cupy.get_default_memory_pool().free_bytes() - scratch, 0

    def new_cache(self, capacity: int) -> GpuKVCache:
        """A fresh sequence; the buffers of the last one of this capacity are reused."""
        if capacity not in self._kv_buffers:
            spec, cupy = self.spec, self.device.cupy
            dtype = {"f16": cupy.float16, "f32": cupy.float32}[self.kv_dtype]
            recurrent = [i for i in range(spec.n_layers) if spec.is_recurrent(i)]
            rows = [0 if i in recurrent else capacity for i in range(spec.n_layers)]
            shape = spec.delta_net
            self._kv_buffers[capacity] = (
                [cupy.zeros((n, spec.n_kv_heads, spec.head_dim_k), dtype) for n in rows],
                [cupy.zeros((n, spec.n_kv_heads, spec.head_dim_v), dtype) for n in rows],
                {i: cupy.zeros((shape.conv_kernel - 1, shape.channels), cupy.float32) for i in recurrent},
                {i: cupy.zeros((shape.value_heads, shape.key_dim, shape.value_dim), cupy.float32) for i in recurrent})
        with self.device.stream:
            return GpuKVCache(self._kv_buffers[capacity], capacity, self.device.stream, self.device.pinned)

    def restore_cache(self, state: CacheState, capacity: int) -> GpuKVCache:
        cache = self.new_cache(capacity)
        cache.restore(state)
        return cache

    # -- the step
    @property
    def captured_steps(self) -> int:
        return self._graphs.captured

    @property
    def step_tokens(self) -> int:
        """The most tokens a captured step takes (decode, and a prompt's last few tokens); 0: none."""
        return MAX_GEMV_TOKENS if self.graphs_enabled else 0

    def run_step(self, forward: Forward, inputs: Any, start: int, graph_key: tuple | None) -> Any:
        """As the protocol's; a layer shard's hidden state may come on the device (a parent's
        device-direct hop), and its output then stays there, queued on the stream."""
        with self.device.stream:
            if self.device.before_step is not None:
                self.device.before_step()
            on_host = isinstance(inputs, np.ndarray)
            if graph_key is not None and len(inputs) <= self.step_tokens and (inputs.ndim == 1 or len(inputs) == 1):
                grouped = start + len(inputs) > GROUPED_ATTENTION_SPAN          # its decode attention kernel
                out = self._graphs.step(forward, inputs, start, (*graph_key, grouped))
            else:
                device_inputs = inputs if not on_host else (
                    self.upload_ids(inputs) if inputs.ndim == 1 else self.vector(inputs))
                out = forward(device_inputs, self.positions(start, len(inputs)))
            return self.to_host(out) if on_host else out

    def hop(self, x: Any, action) -> Any:
        """Eagerly: x to the host and the action's result back. While a step is captured: the
        copies into and out of page-locked buffers are graph nodes, the action a cut between
        segments (it waits for the first copy); the buffers live as long as the captured step."""
        cupy, stream = self.device.cupy, self.device.stream
        runtime = cupy.cuda.runtime
        x = cupy.ascontiguousarray(x)
        if not self.device.capturing:
            return self.vector(action(self.to_host(x)))
        sent, received = self.device.pinned(x.shape, np.float32), self.device.pinned(x.shape, np.float32)
        runtime.memcpyAsync(sent.ctypes.data, x.data.ptr, x.nbytes, runtime.memcpyDeviceToHost, stream.ptr)

        def through_host() -> None:
            stream.synchronize()
            received[...] = action(sent)

        self.device.cut(through_host)
        out = cupy.empty_like(x)
        runtime.memcpyAsync(out.data.ptr, received.ctypes.data, x.nbytes, runtime.memcpyHostToDevice, stream.ptr)
        return out

    # -- operations
    def embed(self, table: DeviceMatrix, ids: Any) -> Any:
        units = table.cols // UNIT
        out = self.device.cupy.empty((ids.size, table.cols), self.device.cupy.float32)
        self.device.elementwise(f"gather_rows_f32_{table.kind}", ids.size * units,
                                (table.data, i64(table.row_bytes), i32(units), i32(ids.size), ids, out))
        return out

    def rms_norm(self, x: Any, weight: Any) -> Any:
        """A few rows are written in 8-bit planes too, for the GEMVs that read them next."""
        x = self.device.cupy.ascontiguousarray(x)      # the kernel reads whole rows: a column slice is copied
        out = self.device.cupy.empty_like(x)
        width = x.shape[-1]
        q, ds = self._planes_for(out)
        self.device.launch("rms_norm", (x.size // width,), (NORM_BLOCK,),
                           (x, weight, out, i32(width), np.float32(self.spec.rms_eps), pointer(q), pointer(ds)))
        return out

    def linear(self, x: Any, weight: DeviceMatrix, bias: Any | None = None, residual: Any | None = None) -> Any:
        """x [T, K] · weight [N, K]ᵀ (+ bias [N]) (+ residual [T, N]) -> [T, N] f32"""
        n_tokens, cupy, kernels = x.shape[0], self.device.cupy, self.device.kernels
        x = cupy.ascontiguousarray(x)
        if n_tokens <= MAX_GEMV_TOKENS and weight.kind in INT_KINDS:
            y = cupy.empty((n_tokens, weight.rows), cupy.float32)
            q, ds = self.q8_of(x)
            one = n_tokens == 1
            kernels.rows(f"gemv_q8_one_{weight.kind}" if one else f"gemv_q8_{weight.kind}",
                         (weight.rows + 1) // 2, weight.cols // UNIT, 1,  # rows in pairs
                         (weight.data, i64(weight.row_bytes), q, ds, i32(weight.cols), y, i32(weight.rows),
                          i32(n_tokens), pointer(residual)), ONE_TOKEN_UNITS_PER_LANE if one else UNITS_PER_LANE,
                         staged_bytes=2 * weight.row_bytes, block=ONE_TOKEN_BLOCK if one else BLOCK)
        elif n_tokens <= MAX_GEMV_TOKENS and weight.rows <= FEW_ROWS:
            y = cupy.empty((n_tokens, weight.rows), cupy.float32)
            stride = stage_stride(weight.row_bytes, 1)
            self.device.launch(f"gemv_few_rows_{weight.kind}", (weight.rows,), (FEW_ROWS_THREADS,),
                               (weight.data, i64(weight.row_bytes), x, i32(weight.cols), y, i32(weight.rows),
                                i32(n_tokens), pointer(residual), i32(stride)), stride)
        elif n_tokens <= MAX_GEMV_TOKENS:
            y = cupy.empty((n_tokens, weight.rows), cupy.float32)
            kernels.rows(f"gemv_{weight.kind}", weight.rows, weight.cols // UNIT, 1,
                         (weight.data, i64(weight.row_bytes), x, i32(weight.cols), y, i32(weight.rows),
                          i32(n_tokens), pointer(residual)))
        elif weight.kind == "f32":          # kept in f32 (routers): exact products
            y = self.blas.matmul(x[None], weight.data.view(cupy.float32).reshape(1, *weight.shape), residual)[0]
        else:
            y = self.blas.matmul(self._f16_of(x)[None], self.dequantize_f16(weight)[None], residual)[0]
        if bias is not None:
            y += bias
        return y

    def linears(self, x: Any, weights: tuple[DeviceMatrix, ...], biases: tuple[Any | None, ...],
                norm: Any | None = None) -> tuple[Any, ...]:
        """x [T, K] (with `norm`: rms_norm(x, norm)) through up to three weights (q, k, v, or a fused
        qkv) (+ biases): one launch for quantized weights and a few tokens, the norm folded into it
        (each block converts the normed rows itself, within NORMED_PLANES_LIMIT), else one product each."""
        n_tokens, width = x.shape
        planes_bytes = n_tokens * width // UNIT * (4 * 16 + 8)                   # [T, K/32] int4 x 4 + float2
        fused = n_tokens <= MAX_GEMV_TOKENS and len(weights) <= 3 and all(w.kind in INT_KINDS for w in weights)
        foldable = width % UNIT == 0 and width <= NORMED_VALUES * BLOCK and planes_bytes <= NORMED_PLANES_LIMIT
        if norm is not None and not (fused and foldable):
            x, norm = self.rms_norm(x, norm), None
        if not fused:
            return tuple(self.linear(x, weight, bias) for weight, bias in zip(weights, biases))
        x = self.device.cupy.ascontiguousarray(x)
        q, ds = (NULL, NULL) if norm is not None else self.q8_of(x)
        outs = tuple(self.device.cupy.empty((n_tokens, w.rows), self.device.cupy.float32) for w in weights)
        segments = [arg for w, y in zip(weights, outs)
                    for arg in (w.data, i64(w.row_bytes), i32(INT_KINDS.index(w.kind)), i32(w.rows), y)]
        segments += [NULL, i64(0), i32(0), i32(0), NULL] * (3 - len(weights))
        one = n_tokens == 1
        self.device.kernels.rows("gemv_q8_three_one" if one else "gemv_q8_three", sum(w.rows for w in weights),
                                 width // UNIT, 1, (*segments, q, ds, x, pointer(norm), np.float32(self.spec.rms_eps),
                                                    i32(width), i32(n_tokens)),
                                 ONE_TOKEN_UNITS_PER_LANE if one else UNITS_PER_LANE,
                                 staged_bytes=max(w.row_bytes for w in weights),
                                 shared_after=0 if norm is None else planes_bytes)
        for y, bias in zip(outs, biases):
            if bias is not None:
                y += bias
        return outs

    def swiglu_ffn(self, x: Any, ffn: tuple[DeviceMatrix, DeviceMatrix, DeviceMatrix],
                   residual: Any | None = None) -> Any:
        """down · (silu(gate · x) · up · x) (+ residual) [T, H]. One token of quantized matrices:
        the FFN as a stack of one expert through the routed experts' two kernels (gate/up writing
        the activations in 8-bit planes, down adding the residual), where the products would take
        five launches and read the 20,480 rows of Qwen2-57B's shared expert at ~2 TB/s
        (docs/benchmarks.md); a few tokens read each matrix once for all of them in the products."""
        gate, up, down = ffn
        if x.shape[0] == 1 and gate.kind == up.kind and {gate.kind, down.kind} <= set(INT_KINDS):
            return self._one_expert.compute_with(LayerExperts(gate, up, 0, down), x, self._expert_zero,
                                                 self._weight_one, residual=residual)
        return swiglu_by_products(self, x, ffn, residual)

    def rope_append(self, q: Any, k: Any, v: Any, q_norm: Any | None, k_norm: Any | None,
                    cache: GpuKVCache, layer: int, positions: Any) -> Any:
        spec = self.spec
        n_tokens = q.shape[0]
        # The kernel reads rows of NH*D, NKV*D and NKV*Dv floats and rotates q in place: column
        # slices of a fused qkv [T, N] are copied out when T > 1 (one row is contiguous already).
        q, k, v = (self.device.cupy.ascontiguousarray(a) for a in (q, k, v))
        self.device.launch(
            f"qk_norm_rope_append_{self.kv_dtype}",
            (n_tokens, spec.n_heads + spec.n_kv_heads), (spec.head_dim_k // 2,),
            (q, k, v, pointer(q_norm), pointer(k_norm), np.float32(spec.rms_eps), positions, self.inv_freq,
             np.float64(1.0 / spec.rope_scale), i32(spec.rule.rope_style == "neox"),
             cache.k[layer], cache.v[layer], i32(spec.n_heads), i32(spec.n_kv_heads),
             i32(spec.head_dim_k), i32(spec.head_dim_v), i32(spec.rotary_dims)))
        return q

    def tree_attention(self, q: Any, cache: GpuKVCache, layer: int, among: np.ndarray) -> Any:
        raise UsageError("tree verifies run on a CPU parent for now: give --draft-branches 1 on a GPU")

    def attention(self, q: Any, cache: GpuKVCache, layer: int, positions: Any) -> Any:
        """Causal attention of q [T, NH*D] over the cache -> [T, NH*Dv]: split-K kernels
        for a few tokens, batched TF32 products for a prefill chunk."""
        if q.shape[0] > MAX_GEMV_TOKENS:
            return self._prefill_attention(q, cache, layer, positions)
        return self._split_attention(q, cache, layer, positions)

    def _split_attention(self, q: Any, cache: GpuKVCache, layer: int, positions: Any) -> Any:
        """Each token's positions [0, pos] in equal shares over a fixed number of splits per row of
        blocks, the count from the capacity, so a captured step serves every position. A step past
        GROUPED_ATTENTION_SPAN positions reads the cache once per tile of a KV head's query heads
        (its walk is bound by memory), a shorter one by a block per query head (its walk is bound by
        latency; docs/benchmarks.md has the measurements); run_step keys captured steps by which."""
        spec, cupy = self.spec, self.device.cupy
        n_tokens = q.shape[0]
        grouped = cache.length + n_tokens > GROUPED_ATTENTION_SPAN
        kernel, blocks = self._grouped_attention if grouped else self._per_head_attention
        splits = attention_splits(cache.capacity, n_tokens * blocks, self.device.kernels.wave(kernel))
        acc = cupy.empty((n_tokens, spec.n_heads, splits, spec.head_dim_v), cupy.float32)    # [T, NH, splits, Dv]
        max_sum = cupy.empty((n_tokens, spec.n_heads, splits, 2), cupy.float32)
        self.device.launch(
            kernel, (n_tokens, blocks, splits), (ATTENTION_THREADS,),
            (q, cache.k[layer], cache.v[layer], positions, i32(spec.n_heads), i32(spec.n_kv_heads),
             i32(spec.head_dim_k), i32(spec.head_dim_v), np.float32(1.0 / math.sqrt(spec.head_dim_k)),
             acc, max_sum))
        out = cupy.empty((n_tokens, spec.n_heads * spec.head_dim_v), cupy.float32)
        q, ds = self._planes_for(out) if spec.head_dim_v % UNIT == 0 else (None, None)
        self.device.launch("attention_combine", (n_tokens, spec.n_heads), (128,),
                           (acc, max_sum, i32(splits), i32(spec.n_heads), i32(spec.head_dim_v), out,
                            pointer(q), pointer(ds)))
        return out

    def _prefill_attention(self, q: Any, cache: GpuKVCache, layer: int, positions: Any) -> Any:
        """Flash attention by blocks of PREFILL_KEY_BLOCK cache positions: per block, scores
        [NH, T, B] = q·kᵀ per head (TF32 products over the block's K expanded per query head), the
        running causal softmax (causal_softmax_block), out += p·v; at the end out divided by the
        rows' sums. What the chunk holds does not grow with the context."""
        spec, cupy, blas = self.spec, self.device.cupy, self.blas
        n_tokens, n_heads, d, dv = q.shape[0], spec.n_heads, spec.head_dim_k, spec.head_dim_v
        span = cache.length + n_tokens
        out = cupy.zeros((n_tokens, n_heads * dv), cupy.float32)                  # Σ e^(score - largest) · v
        running = cupy.zeros((n_heads * n_tokens, 2), cupy.float32)               # largest score, Σ e^(...)
        running[:, 0] = -math.inf
        for first in range(0, span, PREFILL_KEY_BLOCK):
            width = min(PREFILL_KEY_BLOCK, span - first)
            keys = self._expand_heads(cache.k[layer], first, width, d)
            values = self._expand_heads(cache.v[layer], first, width, dv)
            scores = cupy.empty((n_heads, n_tokens, width), cupy.float32)
            blas.gemm(transpose_a=True, transpose_b=False, m=width, n=n_tokens, k=d,
                      a=keys, lda=d, stride_a=width * d, b=q, ldb=n_heads * d, stride_b=d,
                      c=scores, ldc=width, stride_c=n_tokens * width, batch=n_heads, tf32=True)
            self.device.launch("causal_softmax_block", (n_heads * n_tokens,), (BLOCK,),
                               (scores, positions, i32(n_tokens), i32(first), i32(width),
                                np.float32(1.0 / math.sqrt(d)), running, out, i32(n_heads), i32(dv)))
            blas.gemm(transpose_a=False, transpose_b=False, m=dv, n=n_tokens, k=width,
                      a=values, lda=dv, stride_a=width * dv, b=scores, ldb=width, stride_b=n_tokens * width,
                      c=out, ldc=n_heads * dv, stride_c=dv, batch=n_heads, accumulate=True, tf32=True)
        self.device.elementwise("attention_divide", out.size,
                                (out, running, i32(n_tokens), i32(n_heads), i32(dv), np.int64(out.size)))
        return out

    def _expand_heads(self, cache: Any, first: int, width: int, head_dim: int) -> Any:
        """Cache rows [first, first + width) of [S, NKV, D] -> [NH, width, D] f32."""
        spec = self.spec
        out = self.device.cupy.empty((spec.n_heads, width, head_dim), self.device.cupy.float32)
        self.device.elementwise(f"expand_kv_heads_{self.kv_dtype}", out.size // 4,
                                (cache, i32(first), i32(width), i32(spec.n_kv_heads), i32(spec.n_heads),
                                 i32(head_dim), out))
        return out

    def concat(self, parts: list[Any]) -> Any:
        return self.device.cupy.concatenate(parts)

    def route(self, x: Any, norm: Any, router: DeviceMatrix) -> tuple[Any, Any, Any]:
        """h = rms_norm(x, norm), its logits and top-K: one launch (route_normed) for a few tokens
        through a float router of few rows, else the norm, the product and route_top_k."""
        cupy, spec, k = self.device.cupy, self.spec, self.spec.n_experts_used
        x = cupy.ascontiguousarray(x)
        n_tokens, width = x.shape
        ids, weights = cupy.empty((n_tokens, k), cupy.int32), cupy.empty((n_tokens, k), cupy.float32)
        renormalize = i32(spec.rule.renormalize_topk)
        row_threads = max(ROUTE_THREADS, -(-width // (ROUTE_VALUES * 32)) * 32)        # route_normed's blocks
        if (n_tokens > MAX_GEMV_TOKENS or router.kind in INT_KINDS or router.rows > FEW_ROWS or width % UNIT
            or row_threads > 1024):
            h = self.rms_norm(x, norm)
            logits = self.linear(h, router)                                               # [T, E]
            expert_threads = min(1024, -(-router.rows // 32) * 32)                        # a thread per expert
            self.device.launch("route_top_k", (n_tokens,), (expert_threads,),
                               (logits, i32(router.rows), i32(k), renormalize, ids, weights))
            return h, ids, weights
        h = cupy.empty_like(x)
        hq, hds = self._planes_for(h)
        logits = cupy.empty((n_tokens, router.rows), cupy.float32)
        stride = stage_stride(router.row_bytes, 1)
        self.device.launch(f"route_normed_{router.kind}", (router.rows,), (row_threads,),
                           (x, norm, np.float32(spec.rms_eps), i32(width), i32(n_tokens), router.data,
                            i64(router.row_bytes), i32(stride), logits, i32(router.rows), i32(k), renormalize,
                            h, pointer(hq), pointer(hds), self._route_done, ids, weights), stride)
        return h, ids, weights

    def silu_mul(self, gate: Any, up: Any) -> Any:
        out = self.device.cupy.empty_like(gate)
        self.device.elementwise("silu_mul", gate.size, (gate, up, out, i64(gate.size)))
        return out

    def query_gate(self, q_gate: Any) -> tuple[Any, Any]:
        """q_gate [T, NH*2D], each head's query then its gate -> q, gate [T, NH*D]"""
        spec = self.spec
        heads = q_gate.reshape(q_gate.shape[0], spec.n_heads, 2, spec.head_dim_k)
        return tuple(self.device.cupy.ascontiguousarray(heads[:, :, part]).reshape(q_gate.shape[0], -1)
                     for part in (0, 1))

    def sigmoid_gate(self, x: Any, gate: Any) -> Any:
        """x · sigmoid(gate), both [T, N]"""
        out = self.device.cupy.empty_like(x)
        self.device.elementwise("sigmoid_gate", out.size, (x, gate, out, i64(out.size)))
        return out

    def delta_net(self, channels: Any, z: Any, beta: Any, alpha: Any, weights: tuple[Any, Any, Any, Any],
                  cache: GpuKVCache, layer: int) -> Any:
        """A gated DeltaNet layer's mixing (as NumpyBackend.delta_net): the convolution over the
        layer's conv state, then the gated delta rule over its recurrent state, each head's
        output RMS-normed times silu(z) -> [T, HV*DV]."""
        conv_weight, a, dt, norm = weights
        shape, cupy = self.spec.delta_net, self.device.cupy
        n_tokens = channels.shape[0]
        channels, z, beta, alpha = (cupy.ascontiguousarray(x) for x in (channels, z, beta, alpha))
        mixed = cupy.empty((n_tokens, shape.channels), cupy.float32)                   # [T, C]
        self.device.elementwise("delta_conv", n_tokens * shape.channels, (
            channels, conv_weight, cache.conv[layer], mixed, i32(n_tokens), i32(shape.channels),
            i32(shape.conv_kernel)))
        self.device.elementwise("delta_conv_state", shape.channels, (
            channels, cache.conv[layer], i32(n_tokens), i32(shape.channels), i32(shape.conv_kernel)))
        eps = np.float32(self.spec.rms_eps)
        heads = (i32(shape.key_heads), i32(shape.value_heads), i32(shape.key_dim), i32(shape.value_dim))
        block = (-(-max(shape.key_dim, shape.value_dim) // 32) * 32,)                # whole warps over DK and DV
        gates = cupy.empty((n_tokens, shape.value_heads, 2), cupy.float32)             # [T, HV, (g, β)]
        self.device.launch("delta_prepare", (n_tokens, shape.key_heads + shape.value_heads), block,
                           (mixed, beta, alpha, a, dt, gates, *heads, eps))
        out = cupy.empty((n_tokens, shape.value_heads * shape.value_dim), cupy.float32)   # [T, HV*DV]
        self.device.launch("delta_rule", (shape.value_heads, -(-shape.value_dim // DELTA_COLUMNS)),
                           (DELTA_COLUMNS, DELTA_GROUPS),
                           (mixed, gates, cache.ssm[layer], out, i32(n_tokens), *heads))
        self.device.launch("delta_gate_norm", (n_tokens, shape.value_heads), block,
                           (out, z, norm, i32(shape.value_heads), i32(shape.value_dim), eps))
        return out

    def add(self, x: Any, y: Any, gate_logit: Any | None = None) -> Any:
        """x + y, or x + sigmoid(gate_logit [T, 1]) · y"""
        out = self.device.cupy.empty_like(x)
        self.device.elementwise("add_gated", out.size, (x, y, pointer(gate_logit), i32(x.shape[-1]), i64(x.size), out))
        return out

    # -- activation forms
    def q8_of(self, x: Any) -> tuple[Any, Any]:
        """x [T, K] in two 8-bit planes, converted once when the same activations feed several
        products: int8 [T, 2K] (per unit of 32: plane a, plane b) and per unit (d, sx) f32 [T, K/32, 2]."""
        if self._last_q8[0] is not x:
            self._last_q8 = (x, self.quantize_q8(x))
        return self._last_q8[1]

    def quantize_q8(self, x: Any) -> tuple[Any, Any]:
        q, ds = self._planes(x)
        n_units = x.size // UNIT
        self.device.elementwise("quantize_q8", n_units, (x, i64(n_units), q, ds))
        return q, ds

    def _planes(self, x: Any) -> tuple[Any, Any]:
        cupy = self.device.cupy
        return (cupy.empty((*x.shape[:-1], 2 * x.shape[-1]), cupy.int8),
                cupy.empty((*x.shape[:-1], x.shape[-1] // UNIT, 2), cupy.float32))

    def _planes_for(self, out: Any) -> tuple[Any, Any]:
        """Buffers for a kernel to write `out` [T, K] in 8-bit planes as well, remembered as its
        planes; (None, None) where no GEMV would read them (many rows, or K not whole units)."""
        if out.shape[0] > MAX_GEMV_TOKENS or out.shape[-1] % UNIT:
            return None, None
        planes = self._planes(out)
        self._last_q8 = (out, planes)
        return planes

    def _f16_of(self, x: Any) -> Any:
        """x as f16, converted once when the same activations feed several products (q, k, v)."""
        if self._last_f16[0] is not x:
            self._last_f16 = (x, self.to_f16(x))
        return self._last_f16[1]

    def to_f16(self, x: Any) -> Any:
        out = self.device.cupy.empty(x.shape, self.device.cupy.float16)
        self.device.elementwise("to_f16", x.size, (x, out, i64(x.size)))
        return out

    def dequantize_f16(self, weight: DeviceMatrix) -> Any:
        """weight [N, K] -> f16 [N, K]"""
        units = weight.cols // UNIT
        out = self.device.cupy.empty((weight.rows, weight.cols), self.device.cupy.float16)
        self.device.elementwise(f"dequant_f16_{weight.kind}", weight.rows * units,
                                (weight.data, i64(weight.row_bytes), i32(units), i64(weight.rows), out))
        return out
