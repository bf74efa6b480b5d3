"""Synthetic qwen3moe GGUF files: moerun's embedded default model and benchmark models.

Weights are random (seeded, so a file is the same on every machine) except, when
asked, a "bigram" output head: one-hot embeddings and an LM head that hold the
next-token statistics of a text, so sampling from the model produces text that
reads like that text. Everything between (attention, routers, experts) is real
MoE computation with small random weights.

Shape legend: V vocab, H hidden, E experts, F expert FFN width, NH/NKV heads, D head dim.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from moerun.errors import UsageError
from moerun.gguf.vocab import bpe_metadata, byte_level_bpe, pad_vocabulary
from moerun.gguf.writing import write_metadata

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BIGRAM_EMBED_SCALE = 50.0
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class SyntheticConfig:
    name: str = "moerun-synthetic"
    n_layers: int = 4                # L
    hidden: int = 512                # H
    n_heads: int = 8                 # NH
    n_kv_heads: int = 2              # NKV
    head_dim: int = 64               # D
    n_experts: int = 8               # E
    n_experts_used: int = 2          # K
    expert_ff: int = 256             # F
    vocab_size: int = 512            # V (BPE merges trained up to this size)
    context: int = 4096
    ftype: str = "Q8_0"              # F32 | F16 | BF16 | Q8_0 | Q4_0 (2-D weights; norms stay F32)
    weight_std: float = 0.02
    router_std: float = 0.1
    router_skew: float = 0.0         # > 0: a few experts (a seeded random set) win most of the routing
    seed: int = 0


def write_synthetic_model(path: str | Path, config: SyntheticConfig, corpus: str, bigram_head: bool) -> Path:
    """Write the model atomically (temp file + rename) and return its path."""
    path = Path(path)
    tokenizer = byte_level_bpe(corpus, config.vocab_size, SPECIALS)
    meta = pad_vocabulary(bpe_metadata(tokenizer, pre="qwen2", bos=None, eos="<|endoftext|>", chat_template=CHATML),
                      config.vocab_size)
    vocab = len(meta["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(config.seed)
    tensors = _random_tensors(config, vocab, rng)
    if bigram_head:
        if vocab > config.hidden:
            raise UsageError(f"a bigram head needs vocab ({vocab}) <= hidden ({config.hidden})")
        ids = tokenizer.encode(corpus).ids
        tensors["token_embd.weight"], tensors["output.weight"] = _bigram_head(ids, vocab, config.hidden)

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        writer = gguf.GGUFWriter(partial, arch="qwen3moe")
        _write_hparams(writer, config)
        write_metadata(writer, meta)
        for name, array in tensors.items():
            _add_tensor(writer, name, array, config.ftype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _write_hparams(writer: gguf.GGUFWriter, c: SyntheticConfig) -> None:
    writer.add_string("general.name", c.name)
    write_qwen3moe_hparams(writer, c, rope_base=1_000_000.0, rms_eps=1e-6)


def write_qwen3moe_hparams(writer: gguf.GGUFWriter, shape, rope_base: float, rms_eps: float) -> None:
    """The qwen3moe hyper-parameters of `shape` (any object with n_layers, context, hidden,
    expert_ff, n_heads, n_kv_heads, head_dim, n_experts, n_experts_used)."""
    for key, value in {
        "block_count": shape.n_layers, "context_length": shape.context, "embedding_length": shape.hidden,
        "feed_forward_length": shape.expert_ff, "expert_feed_forward_length": shape.expert_ff,
        "attention.head_count": shape.n_heads, "attention.head_count_kv": shape.n_kv_heads,
        "attention.key_length": shape.head_dim, "attention.value_length": shape.head_dim,
        "expert_count": shape.n_experts, "expert_used_count": shape.n_experts_used,
    }.items():
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_float32("qwen3moe.rope.freq_base", rope_base)
    writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", rms_eps)


def _random_tensors(c: SyntheticConfig, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def normal(*shape: int, std: float = c.weight_std) -> np.ndarray:
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    def norm_weight(n: int) -> np.ndarray:
        return (1.0 + normal(n, std=0.05)).astype(np.float32)

    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    tensors = {"token_embd.weight": normal(vocab, c.hidden, std=1.0)}                   # [V, H]
    for i in range(c.n_layers):
        blk = f"blk.{i}"
        tensors |= {
            f"{blk}.attn_norm.weight": norm_weight(c.hidden),
            f"{blk}.attn_q.weight": normal(q_dim, c.hidden),
            f"{blk}.attn_k.weight": normal(kv_dim, c.hidden),
            f"{blk}.attn_v.weight": normal(kv_dim, c.hidden),
            f"{blk}.attn_output.weight": normal(c.hidden, q_dim),
            f"{blk}.attn_q_norm.weight": norm_weight(c.head_dim),
            f"{blk}.attn_k_norm.weight": norm_weight(c.head_dim),
            f"{blk}.ffn_norm.weight": norm_weight(c.hidden),
            f"{blk}.ffn_gate_inp.weight": normal(c.n_experts, c.hidden, std=c.router_std),  # [E, H]
            f"{blk}.ffn_gate_exps.weight": normal(c.n_experts, c.expert_ff, c.hidden),       # [E, F, H]
            f"{blk}.ffn_up_exps.weight": normal(c.n_experts, c.expert_ff, c.hidden),
            f"{blk}.ffn_down_exps.weight": normal(c.n_experts, c.hidden, c.expert_ff),       # [E, H, F]
        }
    tensors["output_norm.weight"] = np.ones(c.hidden, np.float32)
    tensors["output.weight"] = normal(vocab, c.hidden, std=0.05)                         # [V, H]
    if c.router_skew > 0:
        _skew_routing(tensors, c, rng)
    return tensors


def _skew_routing(tensors: dict[str, np.ndarray], c: SyntheticConfig, rng: np.random.Generator) -> None:
    """Give every token a shared direction and point the routers of a random set of
    experts along it, with Zipf-like strength (1/rank): those experts win most tokens."""
    direction = rng.normal(size=c.hidden).astype(np.float32)
    direction /= np.linalg.norm(direction)
    tensors["token_embd.weight"] += 2.0 * direction                                       # [V, H]
    for i in range(c.n_layers):
        rank = rng.permutation(c.n_experts)                                               # [E] popularity rank
        strength = c.router_skew / (1.0 + rank)
        tensors[f"blk.{i}.ffn_gate_inp.weight"] += (strength[:, None] * direction[None, :]).astype(np.float32)


def _bigram_head(ids: list[int], vocab: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """One-hot embeddings and an output head whose logits for token t are
    log P(next | t) from the counts in `ids` (add-0.001 smoothed)."""
    counts = np.full((vocab, vocab), 1e-3)
    np.add.at(counts, (np.asarray(ids[:-1]), np.asarray(ids[1:])), 1.0)
    log_probs = np.log(counts / counts.sum(axis=1, keepdims=True))                        # [V prev, V next]
    embedding = np.zeros((vocab, hidden), np.float32)
    embedding[np.arange(vocab), np.arange(vocab)] = BIGRAM_EMBED_SCALE  # dwarfs what the layers add
    # rms_norm of a one-hot row is sqrt(H) at its token, so divide that back out.
    output = np.zeros((vocab, hidden), np.float32)
    output[:, :vocab] = (log_probs.T / np.sqrt(hidden)).astype(np.float32)
    return embedding, output


def _add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, ftype: str) -> None:
    qtype = gguf.GGMLQuantizationType[ftype]
    if array.ndim == 1 or name.endswith("ffn_gate_inp.weight") or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, array)
        return
    data = gguf.quants.quantize(array, qtype)
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
