"""Write a tiny Hugging Face MoE model to GGUF as llama.cpp's convert_hf_to_gguf.py does.

Tensor names, metadata keys, the llama Q/K row permutation and the rule for
which tensors stay F32 all follow the converter. Q4_0 is not a converter
output type (llama-quantize makes it); it is written "pure" here: every tensor
that Q8_0 would quantize becomes Q4_0.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from moerun.gguf.writing import write_metadata

FTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")

GGUF_ARCH = {"qwen3moe": "qwen3moe", "qwen2moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama"}

_ARCH_OF_MODEL_TYPE = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "mixtral"}

_FILE_TYPE = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# HF name after "model.layers.{i}." -> GGUF name after "blk.{i}."
_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    # dense FFN layers (qwen2moe/qwen3moe `mlp_only_layers`)
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GATE_UP = "mlp.experts.gate_up_proj"  # (E, 2F, H), gate rows first
_GATE_UP_SPLIT = ("ffn_gate_exps.weight", "ffn_up_exps.weight")
_GATE_UP_FUSED = ("ffn_gate_up_exps.weight",)

# Kept F32 whatever the file type, besides 1-D tensors and norms.
_F32_MATRICES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def arch_of(model) -> str:
    """The oracle architecture name (one of hf_models.ARCHS) of a transformers model."""
    return _ARCH_OF_MODEL_TYPE[model.config.model_type]


def gguf_names(hf_name: str, *, fused_gate_up: bool = False) -> tuple[str, ...]:
    """GGUF tensor name(s) holding one HF parameter; gate_up_proj maps to two unless fused."""
    if hf_name in _GLOBAL_NAMES:
        return (_GLOBAL_NAMES[hf_name],)
    _, _, layer, suffix = hf_name.split(".", 3)  # model.layers.{i}.{suffix}
    if suffix == _GATE_UP:
        return tuple(f"blk.{layer}.{name}" for name in (_GATE_UP_FUSED if fused_gate_up else _GATE_UP_SPLIT))
    return (f"blk.{layer}.{_BLOCK_NAMES[suffix]}",)


def rope_permute_heads(model, hf_name: str) -> int | None:
    """Head count the converter permutes this tensor's rows with (llama Q/K only), else None."""
    if arch_of(model) != "mixtral":
        return None
    if hf_name.endswith("self_attn.q_proj.weight"):
        return model.config.num_attention_heads
    if hf_name.endswith("self_attn.k_proj.weight"):
        return model.config.num_key_value_heads
    return None


def permute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Per head, reorder rows from HF's rotate-halves layout to llama.cpp's adjacent pairs."""
    rows = weight.shape[0]
    per_head = weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(model, *, fused_gate_up: bool = False) -> dict[str, np.ndarray]:
    """Every GGUF tensor of `model` as float32 in GGUF numpy order, before quantization."""
    tensors: dict[str, np.ndarray] = {}
    for hf_name, param in model.state_dict().items():
        weight = param.detach().to(torch.float32).numpy()
        if (n_heads := rope_permute_heads(model, hf_name)) is not None:
            weight = permute_rope_rows(weight, n_heads)
        names = gguf_names(hf_name, fused_gate_up=fused_gate_up)
        parts = np.split(weight, len(names), axis=1) if len(names) > 1 else [weight]  # (E, 2F, H) -> 2 x (E, F, H)
        tensors.update((name, np.ascontiguousarray(part)) for name, part in zip(names, parts))
    return tensors


def storage_type(gguf_name: str, ndim: int, ftype: str) -> gguf.GGMLQuantizationType:
    """The converter's choice: 1-D, norms and routers stay F32, everything else gets `ftype`."""
    if ndim <= 1 or gguf_name.endswith("_norm.weight") or gguf_name.endswith(_F32_MATRICES):
        return gguf.GGMLQuantizationType.F32
    return gguf.GGMLQuantizationType[ftype]


def write_gguf(model, path, ftype: str = "F32", *, fused_gate_up: bool = False,
               tokenizer_metadata: dict | None = None) -> Path:
    """Write `model` to `path` as a complete GGUF model file and return the path."""
    if ftype not in FTYPES:
        raise ValueError(f"ftype must be one of {FTYPES}, got {ftype!r}")
    path = Path(path)
    arch = arch_of(model)
    writer = gguf.GGUFWriter(path, GGUF_ARCH[arch])
    _write_hparams(writer, model, arch, ftype)
    if tokenizer_metadata is None:
        tokenizer_metadata = byte_level_vocab(model.config.vocab_size)
    write_metadata(writer, tokenizer_metadata)
    for name, weight in gguf_tensors(model, fused_gate_up=fused_gate_up).items():
        qtype = storage_type(name, weight.ndim, ftype)
        try:
            data = gguf.quants.quantize(weight, qtype)
        except gguf.QuantError:  # row length not a block multiple: the converter falls back to F16
            qtype = gguf.GGMLQuantizationType.F16
            data = gguf.quants.quantize(weight, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hparams(writer: gguf.GGUFWriter, model, arch: str, ftype: str) -> None:
    config = model.config
    hparams = config.to_dict()
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5 if arch == "olmoe" else config.rms_norm_eps)  # the converter pins olmoe's
    writer.add_expert_count(hparams.get("num_local_experts") or hparams["num_experts"])
    writer.add_expert_used_count(config.num_experts_per_tok)
    if hparams.get("head_dim") is not None:
        writer.add_key_length(hparams["head_dim"])
        writer.add_value_length(hparams["head_dim"])
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if hparams.get("shared_expert_intermediate_size") is not None:
            writer.add_expert_shared_feed_forward_length(hparams["shared_expert_intermediate_size"])
    if dense := sorted(hparams.get("mlp_only_layers") or []):
        writer.add_leading_dense_block_count(len(dense) if dense == list(range(len(dense))) else 0)
    if arch == "mixtral":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(hparams.get("head_dim") or config.hidden_size // config.num_attention_heads)
    writer.add_file_type(_FILE_TYPE[ftype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def byte_level_vocab(vocab_size: int) -> dict:
    """Minimal gpt2-style tokenizer metadata: 256 byte tokens, two merges, <|endoftext|>, padding."""
    byte_tokens = [_BYTE_TO_UNICODE[b] for b in range(256)]
    merged = ["Ġt", "he"]
    tokens = byte_tokens + merged + ["<|endoftext|>"]
    eos_id = len(tokens) - 1
    types = [gguf.TokenType.NORMAL] * eos_id + [gguf.TokenType.CONTROL]
    padding = [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens + padding,
        "tokenizer.ggml.token_type": [int(t) for t in types] + [int(gguf.TokenType.UNUSED)] * len(padding),
        "tokenizer.ggml.merges": ["Ġ t", "h e"],
        "tokenizer.ggml.bos_token_id": eos_id,
        "tokenizer.ggml.eos_token_id": eos_id,
        "tokenizer.ggml.add_bos_token": False,
    }


def _gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    unprintable = [b for b in range(256) if b not in mapping]
    mapping.update((b, chr(256 + i)) for i, b in enumerate(unprintable))
    return mapping


_BYTE_TO_UNICODE = _gpt2_byte_to_unicode()
