"""Benchmark GGUF files: real model dimensions, random but valid quantized weights.

    python scripts/make_bench_model.py -o /tmp/qwen3-30b-a3b-q4_k_m.gguf                  # ~18 GiB
    python scripts/make_bench_model.py -o /tmp/q8.gguf --mix q8_0 --layers 4
    python scripts/make_bench_model.py -o /tmp/tiny.gguf --preset tiny

The file has the tensor names, shapes and types of a real model of its architecture (qwen3moe,
qwen2moe, olmoe, Mixtral's llama, qwen35moe), so every kernel reads the same bytes it would read
for the real one, and a small vocabulary
(a byte-level BPE padded with unused tokens to the real size) so `moerun run` and
`moerun bench` work on it. Its text is gibberish: only its speed means anything.

The q4_k_m mix simplifies llama.cpp's Q4_K_M: every attn_v and ffn_down_exps is Q6_K (llama.cpp
picks about half of them), so the Qwen3-30B-A3B file is 18.4 GiB where a real Q4_K_M is 17.3 GiB.
A matrix whose rows do not fill whole K-quant blocks of 256 takes llama.cpp's fallback type
(Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), as Qwen1.5-MoE's expert FFN width of 1408 does.

Quantized blocks are random bytes with their scale fields overwritten by small valid
values, chosen so every type dequantizes to weights of mean ~0 and std WEIGHT_STD.
Data is generated and written a few MiB at a time, so a file of any size needs
little memory.

Routing is shaped to load the experts as a trained model does. With every weight random, the
attention of each layer averages its values over the positions and so adds nearly the same
vector to every token; in the Qwen3-30B-A3B shape that shared vector is ~90% of every router
input from the second layer on, and one expert gets almost every token of a prompt. The shared
vector differs from prompt to prompt (two prompts' are nearly orthogonal), so no fixed router
rows can ignore it. Instead the attn_norm weights are scaled by ATTN_NORM_SCALE, which in
qwen3moe (Q and K are normalised per head) scales only V and the attention output, leaving the
stream to the token embedding and the experts' outputs, which differ per token. Router rows are
random directions with log-normal norms: a longer row wins top-K more often, which makes a
moderately hot head. Over a 512-token prompt the hottest expert of a layer then gets 3-5x the
mean load and nearly every expert gets some tokens (tests/unit/test_bench_model.py checks it on
a small shape).

Shape legend: V vocab, H hidden, E experts, F expert FFN width, NH/NKV heads, D head dim.
"""
from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from moerun.errors import UsageError
from moerun.gguf.quants import tensor_nbytes
from moerun.gguf.vocab import bpe_metadata, byte_level_bpe, pad_vocabulary
from moerun.gguf.writing import write_metadata
from moerun.writers.demo import demo_corpus

Q = GGMLQuantizationType
WEIGHT_STD = 0.02       # every quantized matrix, the embedding and the LM head included
NORM_STD = 0.05         # norm weights are 1 + N(0, NORM_STD), attn_norm's times ATTN_NORM_SCALE
ATTN_NORM_SCALE = 0.1   # attention adds a tenth as much to the residual stream: see routing, above
ROUTER_STD = 0.05       # router logits get std ~ROUTER_STD * sqrt(H), times the expert's norm factor
ROUTER_NORM_SPREAD = 0.25   # sigma of the log-normal norm factor of each router row
CHUNK_BYTES = 2 << 20   # quantized data is generated and written this much at a time
MAX_PENDING_WRITES = 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class BenchShape:
    name: str
    arch: str               # the GGUF architecture: qwen3moe, qwen2moe, olmoe, llama (Mixtral), qwen35moe
    n_layers: int           # L
    hidden: int             # H
    n_heads: int            # NH
    n_kv_heads: int         # NKV
    head_dim: int           # D
    n_experts: int          # E
    n_experts_used: int     # K
    expert_ff: int          # F
    vocab: int              # V
    context: int
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    shared_ff: int = 0      # a shared expert beside the routed ones, gated by sigmoid (qwen2moe, qwen35moe)
    hybrid: HybridShape | None = None       # qwen35moe: gated DeltaNet layers, gated attention


@dataclass(frozen=True)
class HybridShape:
    """What a qwen35moe shape adds: every `full_attention_interval`-th layer attends (its attn_q
    holds the gates too, rope over `rope_dims`), the others are gated DeltaNet of HK/HV heads of
    DK/DV."""
    full_attention_interval: int
    rope_dims: int
    key_heads: int          # HK
    value_heads: int        # HV
    key_dim: int            # DK
    value_dim: int          # DV
    conv_kernel: int

    def is_recurrent(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0


PRESETS: dict[str, BenchShape] = {
    "qwen3-30b-a3b": BenchShape(name="Qwen3-30B-A3B", arch="qwen3moe", n_layers=48, hidden=2048, n_heads=32,
                                n_kv_heads=4, head_dim=128, n_experts=128, n_experts_used=8, expert_ff=768,
                                vocab=151936, context=40960),
    "qwen3-235b-a22b": BenchShape(name="Qwen3-235B-A22B", arch="qwen3moe", n_layers=94, hidden=4096, n_heads=64,
                                  n_kv_heads=4, head_dim=128, n_experts=128, n_experts_used=8, expert_ff=1536,
                                  vocab=151936, context=40960),
    "qwen3.6-35b-a3b": BenchShape(name="Qwen3.6-35B-A3B", arch="qwen35moe", n_layers=40, hidden=2048, n_heads=16,
                                  n_kv_heads=2, head_dim=256, n_experts=256, n_experts_used=8, expert_ff=512,
                                  vocab=248320, context=262144, rope_base=10_000_000.0, shared_ff=512,
                                  hybrid=HybridShape(full_attention_interval=4, rope_dims=64, key_heads=16,
                                                     value_heads=32, key_dim=128, value_dim=128, conv_kernel=4)),
    "mixtral-8x7b": BenchShape(name="Mixtral-8x7B", arch="llama", n_layers=32, hidden=4096, n_heads=32,
                               n_kv_heads=8, head_dim=128, n_experts=8, n_experts_used=2, expert_ff=14336,
                               vocab=32000, context=32768, rms_eps=1e-5),
    "qwen1.5-moe-a2.7b": BenchShape(name="Qwen1.5-MoE-A2.7B", arch="qwen2moe", n_layers=24, hidden=2048,
                                    n_heads=16, n_kv_heads=16, head_dim=128, n_experts=60, n_experts_used=4,
                                    expert_ff=1408, vocab=151936, context=8192, shared_ff=5632),
    "qwen2-57b-a14b": BenchShape(name="Qwen2-57B-A14B", arch="qwen2moe", n_layers=28, hidden=3584, n_heads=28,
                                 n_kv_heads=4, head_dim=128, n_experts=64, n_experts_used=8, expert_ff=2560,
                                 vocab=151936, context=32768, shared_ff=20480),
    "olmoe-1b-7b": BenchShape(name="OLMoE-1B-7B", arch="olmoe", n_layers=16, hidden=2048, n_heads=16,
                              n_kv_heads=16, head_dim=128, n_experts=64, n_experts_used=8, expert_ff=1024,
                              vocab=50304, context=4096, rope_base=10_000.0, rms_eps=1e-5),
    # the same structures at a size tests run in milliseconds
    "tiny": BenchShape(name="tiny-qwen3moe", arch="qwen3moe", n_layers=2, hidden=256, n_heads=4, n_kv_heads=2,
                       head_dim=64, n_experts=8, n_experts_used=2, expert_ff=256, vocab=1024, context=4096),
    "tiny-hybrid": BenchShape(name="tiny-qwen35moe", arch="qwen35moe", n_layers=4, hidden=256, n_heads=4,
                              n_kv_heads=2, head_dim=64, n_experts=8, n_experts_used=2, expert_ff=256, vocab=1024,
                              context=4096, shared_ff=256,
                              hybrid=HybridShape(full_attention_interval=4, rope_dims=16, key_heads=2,
                                                 value_heads=4, key_dim=64, value_dim=64, conv_kernel=4)),
}
REAL_SHAPES = tuple(name for name in PRESETS if not name.startswith("tiny"))


def reduced(shape: BenchShape, n_layers: int = 2, width: int = 8) -> BenchShape:
    """The same structure at a size tests run quickly: `n_layers` layers; the hidden size, heads,
    FFN widths, experts and vocabulary divided by about `width`; kept: head dims, query heads per KV
    head, experts per token, and whether a width fills whole 256-blocks (part of the structure:
    it picks the quant types)."""
    def narrow(value: int) -> int:
        if value % 256:
            return max(value % 256 + 256, value // width // 256 * 256 + value % 256)
        return value if value == 0 else max(256, value // width // 256 * 256)

    kv_heads = max(1, shape.n_kv_heads // width)                      # the query heads per KV head kept
    return dataclasses.replace(shape, name=f"{shape.name}/{width}", n_layers=n_layers, hidden=narrow(shape.hidden),
                               n_heads=kv_heads * (shape.n_heads // shape.n_kv_heads), n_kv_heads=kv_heads,
                               expert_ff=narrow(shape.expert_ff), shared_ff=narrow(shape.shared_ff),
                               n_experts=max(2 * shape.n_experts_used, shape.n_experts // width),
                               vocab=max(1024, shape.vocab // 64))


@dataclass(frozen=True)
class QuantMix:
    """Which GGML type each matrix gets; norms and routers are always F32."""
    label: str
    file_type: LlamaFileType
    default: GGMLQuantizationType
    by_role: Mapping[str, GGMLQuantizationType]   # role = tensor name without "blk.N." and ".weight"


MIXES: dict[str, QuantMix] = {
    "q4_k_m": QuantMix("Q4_K_M", LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K,
                       {"attn_v": Q.Q6_K, "ffn_down_exps": Q.Q6_K, "output": Q.Q6_K}),
    "q5_k_m": QuantMix("Q5_K_M", LlamaFileType.MOSTLY_Q5_K_M, Q.Q5_K,
                       {"attn_v": Q.Q6_K, "ffn_down_exps": Q.Q6_K, "output": Q.Q6_K}),
    "q8_0": QuantMix("Q8_0", LlamaFileType.MOSTLY_Q8_0, Q.Q8_0, {}),
}
F32_ROLES = frozenset({"attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp", "output_norm",
                       "post_attention_norm", "ffn_gate_inp_shexp", "ssm_conv1d", "ssm_a", "ssm_dt", "ssm_norm"})
# llama.cpp's type for a matrix whose rows are no whole number of K-quant blocks
K_QUANT_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]   # numpy order: rows along the last axis
    ggml_type: GGMLQuantizationType

    @property
    def role(self) -> str:
        return tensor_role(self.name)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.ggml_type, self.shape)


def tensor_role(name: str) -> str:
    """The name without "blk.N." and ".weight" (or ".bias"): attn_v, ffn_down_exps, output, ssm_dt, ..."""
    return name.removesuffix(".weight").removesuffix(".bias").split(".")[-1]


def tensor_plan(shape: BenchShape, mix: QuantMix) -> list[TensorPlan]:
    """Every tensor of the file in writing order; ValueError when a row does not fit its type's blocks."""
    s = shape
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (s.vocab, s.hidden)}            # [V, H]
    for i in range(s.n_layers):
        shapes |= _layer(s, i)
    shapes |= {"output_norm.weight": (s.hidden,), "output.weight": (s.vocab, s.hidden)}       # [V, H]

    plan = []
    for name, dims in shapes.items():
        role = tensor_role(name)
        ggml_type = Q.F32 if role in F32_ROLES or name.endswith(".bias") else mix.by_role.get(role, mix.default)
        if ggml_type in K_QUANT_FALLBACK and dims[-1] % GGML_QUANT_SIZES[ggml_type][0]:
            ggml_type = K_QUANT_FALLBACK[ggml_type]
        try:
            tensor_nbytes(ggml_type, dims)
        except ValueError as err:
            raise UsageError(f"{name} {list(dims)} cannot be stored as {ggml_type.name}: {err}") from None
        plan.append(TensorPlan(name, dims, ggml_type))
    return plan


def _layer(s: BenchShape, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's tensors: attention (a qwen35moe layer's gated DeltaNet, or its gated attention
    whose attn_q holds each head's gate too), the routed experts, and the shared expert where the
    shape has one."""
    blk, h = f"blk.{i}", s.hybrid
    if h is None:
        mixer, ffn_norm = _attention(s, blk), "ffn_norm"
    else:
        mixer, ffn_norm = _delta_net(s, blk) if h.is_recurrent(i) else _attention(s, blk), "post_attention_norm"
    return {f"{blk}.attn_norm.weight": (s.hidden,), **mixer, f"{blk}.{ffn_norm}.weight": (s.hidden,),
            **_experts(s, blk), **(_shared_expert(s, blk) if s.shared_ff else {})}


def _attention(s: BenchShape, blk: str) -> dict[str, tuple[int, ...]]:
    """The projections, and by architecture: q/k RMSNorm per head (qwen3moe, qwen35moe) or over
    the whole projection (olmoe), q/k/v biases (qwen2moe), neither (llama)."""
    q_dim, kv_dim = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    tensors = {f"{blk}.attn_q.weight": ((2 if s.hybrid else 1) * q_dim, s.hidden),
               f"{blk}.attn_k.weight": (kv_dim, s.hidden),
               f"{blk}.attn_v.weight": (kv_dim, s.hidden),
               f"{blk}.attn_output.weight": (s.hidden, q_dim)}
    if s.arch in ("qwen3moe", "qwen35moe"):
        tensors |= {f"{blk}.attn_q_norm.weight": (s.head_dim,), f"{blk}.attn_k_norm.weight": (s.head_dim,)}
    elif s.arch == "olmoe":
        tensors |= {f"{blk}.attn_q_norm.weight": (q_dim,), f"{blk}.attn_k_norm.weight": (kv_dim,)}
    elif s.arch == "qwen2moe":
        tensors |= {f"{blk}.attn_q.bias": (q_dim,), f"{blk}.attn_k.bias": (kv_dim,), f"{blk}.attn_v.bias": (kv_dim,)}
    return tensors


def _shared_expert(s: BenchShape, blk: str) -> dict[str, tuple[int, ...]]:
    return {f"{blk}.ffn_gate_inp_shexp.weight": (1, s.hidden),                              # [1, H]
            f"{blk}.ffn_gate_shexp.weight": (s.shared_ff, s.hidden),
            f"{blk}.ffn_up_shexp.weight": (s.shared_ff, s.hidden),
            f"{blk}.ffn_down_shexp.weight": (s.hidden, s.shared_ff)}


def _delta_net(s: BenchShape, blk: str) -> dict[str, tuple[int, ...]]:
    """C = 2·HK·DK + HV·DV channels through the convolution."""
    h = s.hybrid
    channels, inner = 2 * h.key_heads * h.key_dim + h.value_heads * h.value_dim, h.value_heads * h.value_dim
    return {f"{blk}.attn_qkv.weight": (channels, s.hidden), f"{blk}.attn_gate.weight": (inner, s.hidden),
            f"{blk}.ssm_beta.weight": (h.value_heads, s.hidden),
            f"{blk}.ssm_alpha.weight": (h.value_heads, s.hidden),
            f"{blk}.ssm_a": (h.value_heads,), f"{blk}.ssm_dt.bias": (h.value_heads,),
            f"{blk}.ssm_conv1d.weight": (channels, h.conv_kernel), f"{blk}.ssm_norm.weight": (h.value_dim,),
            f"{blk}.ssm_out.weight": (s.hidden, inner)}


def _experts(s: BenchShape, blk: str) -> dict[str, tuple[int, ...]]:
    return {f"{blk}.ffn_gate_inp.weight": (s.n_experts, s.hidden),                          # [E, H]
            f"{blk}.ffn_gate_exps.weight": (s.n_experts, s.expert_ff, s.hidden),            # [E, F, H]
            f"{blk}.ffn_up_exps.weight": (s.n_experts, s.expert_ff, s.hidden),
            f"{blk}.ffn_down_exps.weight": (s.n_experts, s.hidden, s.expert_ff)}            # [E, H, F]


# ---- random valid blocks -------------------------------------------------------------------------
#
# Random bytes make the quants uniform over their levels; only the scale fields are set:
#   Q8_0  34 B / 32:  d f16 | qs int8[32]                  w = d * q, d of random sign
#   Q4_K 144 B / 256: d | dmin | scales 12 B | qs 128 B     w = d * sc * q - dmin * m   (8 sub-blocks of 32)
#   Q5_K 176 B / 256: d | dmin | scales 12 B | qh 32 B | qs 128 B
#   Q6_K 210 B / 256: ql 128 B | qh 64 B | scales int8[16] | d   w = d * sc * (q - 32)  (16 sub-blocks of 16)
# K-quant sub-block scales are drawn from a small range; Q4_K/Q5_K mins equal their scales and
# dmin = d * (mean quant level), so each sub-block has mean 0; Q6_K scales have random signs.

K_SCALES = np.arange(16, 32)     # 6-bit Q4_K/Q5_K sub-block scales: 16 + a random nibble
Q6_SCALES = np.arange(8, 16)     # int8 Q6_K sub-block scale magnitudes: 8 + 3 random bits, random sign


def _uniform_sd(levels: int) -> float:
    """Std of an integer drawn uniformly from `levels` consecutive values."""
    return float(np.sqrt((levels**2 - 1) / 12))


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))


def _set_f16(blocks: np.ndarray, offset: int, value: float) -> None:
    blocks[:, offset:offset + 2].view("<u2")[:] = np.float16(value).view(np.uint16)


def _set_k_scales(packed: np.ndarray) -> None:
    """packed [N, 12] random bytes -> 8 scales and 8 equal mins, each 16..31, as ggml packs them:
    bytes 0-3: scale j (6 bits) | high 2 bits of scale j+4 << 6;  bytes 4-7: the same for the mins;
    bytes 8-11: low nibble of scale j+4 | low nibble of min j+4 << 4.
    Every value is 16 + a random nibble, so its high 2 bits are 01. Worked on 4 bytes at a time."""
    words = packed.view("<u4")                                     # [N, 3]
    words[:, 0] = (words[:, 0] & 0x0F0F0F0F) | 0x50505050          # 0x40: high bits 01 of scale j+4
    words[:, 1] = words[:, 0]
    words[:, 2] = (words[:, 2] & 0x0F0F0F0F) * 0x11


def _fill_q8_0(blocks: np.ndarray, std: float) -> None:
    d_bits = blocks[:, 0:2].view("<u2")
    d_bits &= 0x8000                                     # keep a random sign: expected mean 0
    d_bits |= np.float16(std / _uniform_sd(256)).view(np.uint16)


def _fill_q5_0(blocks: np.ndarray, std: float) -> None:
    d_bits = blocks[:, 0:2].view("<u2")                  # w = d * (q - 16), q of 5 bits
    d_bits &= 0x8000
    d_bits |= np.float16(std / _uniform_sd(32)).view(np.uint16)


def _fill_q5_1(blocks: np.ndarray, std: float) -> None:
    d = std / _uniform_sd(32)                            # w = d * q + m, q of 5 bits
    _set_f16(blocks, 0, d)
    _set_f16(blocks, 2, -15.5 * d)                       # mean 5-bit level 15.5


def _fill_q4_k(blocks: np.ndarray, std: float) -> None:
    d = std / (_rms(K_SCALES) * _uniform_sd(16))
    _set_f16(blocks, 0, d)
    _set_f16(blocks, 2, 7.5 * d)                         # mean nibble 7.5
    _set_k_scales(blocks[:, 4:16])


def _fill_q5_k(blocks: np.ndarray, std: float) -> None:
    d = std / (_rms(K_SCALES) * _uniform_sd(32))
    _set_f16(blocks, 0, d)
    _set_f16(blocks, 2, 15.5 * d)                        # mean 5-bit level 15.5
    _set_k_scales(blocks[:, 4:16])


def _fill_q6_k(blocks: np.ndarray, std: float) -> None:
    words = blocks[:, 192:208].view("<u4")                         # [N, 4]: 16 int8 scales
    negative = (words >> 7) & 0x01010101                           # 1 in each byte whose sign bit is set
    magnitude = (words & 0x07070707) | 0x08080808                  # 8..15
    words[:] = (magnitude ^ (negative * 0xFF)) + negative          # two's complement per byte: -15..-8
    _set_f16(blocks, 208, std / (_rms(Q6_SCALES) * _uniform_sd(64)))


BLOCK_FILLERS: dict[GGMLQuantizationType, Callable[[np.ndarray, float], None]] = {
    Q.Q8_0: _fill_q8_0, Q.Q5_0: _fill_q5_0, Q.Q5_1: _fill_q5_1, Q.Q4_K: _fill_q4_k, Q.Q5_K: _fill_q5_k,
    Q.Q6_K: _fill_q6_k,
}


def random_blocks(ggml_type: GGMLQuantizationType, n_blocks: int, rng: np.random.Generator,
                  std: float = WEIGHT_STD) -> np.ndarray:
    """n_blocks random valid blocks of `ggml_type`, uint8 [n_blocks, block bytes]."""
    fill = BLOCK_FILLERS.get(ggml_type)
    if fill is None:
        have = ", ".join(t.name for t in BLOCK_FILLERS)
        raise UsageError(f"no random block writer for {ggml_type.name} (have {have})")
    type_size = GGML_QUANT_SIZES[ggml_type][1]
    nbytes = n_blocks * type_size
    words = rng.bit_generator.random_raw(-(-nbytes // 8))      # 64 random bits at a time: the fastest source
    blocks = words.view(np.uint8)[:nbytes].reshape(n_blocks, type_size)
    fill(blocks, std)
    return blocks


def _tensor_data(tensor: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The tensor's bytes, CHUNK_BYTES or so at a time."""
    if tensor.ggml_type == Q.F32:
        if tensor.role == "ffn_gate_inp":
            yield _router_rows(tensor.shape, rng)
        elif tensor.role in ("ssm_conv1d", "ffn_gate_inp_shexp", "ssm_dt") or tensor.name.endswith(".bias"):
            yield rng.normal(0.0, 0.3 if tensor.role == "ssm_conv1d" else WEIGHT_STD, tensor.shape).astype(np.float32)
        elif tensor.role == "ssm_a":                    # -exp(A_log): each head's decay rate
            yield -rng.uniform(0.5, 2.0, tensor.shape).astype(np.float32)
        else:
            scale = ATTN_NORM_SCALE if tensor.role == "attn_norm" else 1.0
            yield (scale * (1.0 + rng.normal(0.0, NORM_STD, tensor.shape))).astype(np.float32)
        return
    block_size, type_size = GGML_QUANT_SIZES[tensor.ggml_type]
    n_blocks = prod(tensor.shape) // block_size
    per_chunk = max(1, CHUNK_BYTES // type_size)
    for start in range(0, n_blocks, per_chunk):
        yield random_blocks(tensor.ggml_type, min(per_chunk, n_blocks - start), rng)


def _router_rows(shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """ffn_gate_inp [E, H]: random unit directions times ROUTER_STD * sqrt(H) times a log-normal
    factor per expert. An expert whose factor is high gets large logits more often, so it is among
    the top K for more tokens: the head of hot experts that trained routers have."""
    n_experts, hidden = shape
    rows = rng.normal(0.0, 1.0, shape)                                              # [E, H]
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    norms = ROUTER_STD * np.sqrt(hidden) * np.exp(rng.normal(0.0, ROUTER_NORM_SPREAD, n_experts))   # [E]
    return (rows * norms[:, None]).astype(np.float32)


# ---- the file ------------------------------------------------------------------------------------

def write_bench_model(path: str | Path, shape: BenchShape, mix: QuantMix, seed: int = 0,
                      progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the model atomically (temp file + rename) and return its path.
    `progress(bytes_generated, total_bytes)` is called after every tensor."""
    path = Path(path)
    plan = tensor_plan(shape, mix)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        writer = gguf.GGUFWriter(partial, arch=shape.arch)
        _write_hparams(writer, shape, mix)
        write_metadata(writer, vocabulary_metadata(shape.vocab))
        for tensor in plan:
            writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32), tensor.nbytes,
                                   raw_dtype=tensor.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        # GGUFWriter wants each tensor whole in memory; the data section is streamed instead.
        _append_tensor_data(partial, plan, np.random.default_rng(seed), writer.data_alignment, progress)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _append_tensor_data(path: Path, plan: list[TensorPlan], rng: np.random.Generator, alignment: int,
                        progress: Callable[[int, int], None] | None) -> None:
    """Each tensor starts aligned, as the tensor index says. A writer thread writes one chunk
    while the next is generated; at most MAX_PENDING_WRITES chunks wait in memory."""
    total = sum(t.nbytes for t in plan)
    generated = 0
    with path.open("ab") as out, ThreadPoolExecutor(max_workers=1) as writer:
        position = out.tell()
        pending: deque[Future] = deque()

        def write(data: np.ndarray | bytes) -> None:
            nonlocal position
            pending.append(writer.submit(out.write, data))
            position += memoryview(data).nbytes
            if len(pending) > MAX_PENDING_WRITES:
                pending.popleft().result()

        for tensor in plan:
            write(bytes(-position % alignment))
            for chunk in _tensor_data(tensor, rng):
                write(chunk)
            generated += tensor.nbytes
            if progress is not None:
                progress(generated, total)
        write(bytes(-position % alignment))
        for done in pending:
            done.result()


def with_layers(shape: BenchShape, n_layers: int) -> BenchShape:
    if n_layers < 1:
        raise UsageError(f"--layers must be at least 1 (got {n_layers})")
    return dataclasses.replace(shape, n_layers=n_layers)


def vocabulary_metadata(vocab: int) -> dict:
    """tokenizer.ggml.* keys: a byte-level BPE trained on moerun's small default corpus (at most
    `vocab` tokens), padded with unused [PAD<id>] tokens to `vocab` ids. No chat template."""
    corpus = demo_corpus()
    return pad_vocabulary(bpe_metadata(byte_level_bpe(corpus, vocab, SPECIALS), pre="qwen2", bos=None,
                                       eos="<|endoftext|>", chat_template=None), vocab)


def _write_hparams(writer: gguf.GGUFWriter, s: BenchShape, mix: QuantMix) -> None:
    """The keys llama.cpp's converter writes for the architecture (extra ones are harmless): llama
    reads the expert width from feed_forward_length, qwen*moe from expert_feed_forward_length."""
    writer.add_string("general.name", f"{s.name} bench")
    writer.add_uint32("general.file_type", int(mix.file_type))
    writer.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    keys = {
        "block_count": s.n_layers, "context_length": s.context, "embedding_length": s.hidden,
        "feed_forward_length": s.expert_ff, "expert_feed_forward_length": s.expert_ff,
        "attention.head_count": s.n_heads, "attention.head_count_kv": s.n_kv_heads,
        "attention.key_length": s.head_dim, "attention.value_length": s.head_dim,
        "expert_count": s.n_experts, "expert_used_count": s.n_experts_used,
        "rope.dimension_count": s.hybrid.rope_dims if s.hybrid else s.head_dim,
    }
    if s.shared_ff:
        keys["expert_shared_feed_forward_length"] = s.shared_ff
    if s.hybrid is not None:
        h = s.hybrid
        keys |= {"ssm.conv_kernel": h.conv_kernel, "ssm.state_size": h.key_dim, "ssm.group_count": h.key_heads,
                 "ssm.time_step_rank": h.value_heads, "ssm.inner_size": h.value_heads * h.value_dim,
                 "full_attention_interval": h.full_attention_interval}
        pairs = h.rope_dims // 2                # time, height and width sections over them ([11, 11, 10] at 32)
        time_height = -(-pairs // 3)
        writer.add_array(f"{s.arch}.rope.dimension_sections", [time_height, time_height, pairs - 2 * time_height, 0])
    for key, value in keys.items():
        writer.add_uint32(f"{s.arch}.{key}", value)
    writer.add_float32(f"{s.arch}.rope.freq_base", s.rope_base)
    writer.add_float32(f"{s.arch}.attention.layer_norm_rms_epsilon", s.rms_eps)
