"""Write a tiny Hugging Face MoE model to GGUF as llama.cpp's convert_hf_to_gguf.py does.

Tensor names, metadata keys, the llama Q/K row permutation, qwen35moe's transforms (norms
+1, -exp(A_log), value heads from grouped to tiled order) and the rule for which tensors stay
F32 all follow the converter. Q4_0 is not a converter
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

GGUF_ARCH = {"qwen3moe": "qwen3moe", "qwen2moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama",
             "qwen35moe": "qwen35moe"}

_ARCH_OF_MODEL_TYPE = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "mixtral",
                       "qwen3_5_moe_text": "qwen35moe"}

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
    # qwen35moe: gated DeltaNet layers, and the FFN norm's name
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
QWEN35_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight"}
_GATE_UP = "mlp.experts.gate_up_proj"  # (E, 2F, H), gate rows first
_GATE_UP_SPLIT = ("ffn_gate_exps.weight", "ffn_up_exps.weight")
_GATE_UP_FUSED = ("ffn_gate_up_exps.weight",)

# Kept F32 whatever the file type, besides 1-D tensors, norms and names not ending in .weight.
_F32_MATRICES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def arch_of(model) -> str:
    """The oracle architecture name (one of hf_models.ARCHS) of a transformers model."""
    return _ARCH_OF_MODEL_TYPE[model.config.model_type]


def gguf_names(hf_name: str, *, fused_gate_up: bool = False, names: dict[str, str] | None = None) -> tuple[str, ...]:
    """GGUF tensor name(s) holding one HF parameter; gate_up_proj maps to two unless fused;
    `names`: an architecture's own names, before the common ones."""
    names = names or {}
    if hf_name in _GLOBAL_NAMES:
        return (_GLOBAL_NAMES[hf_name],)
    _, _, layer, suffix = hf_name.split(".", 3)  # model.layers.{i}.{suffix}
    if suffix == _GATE_UP:
        return tuple(f"blk.{layer}.{name}" for name in (_GATE_UP_FUSED if fused_gate_up else _GATE_UP_SPLIT))
    return (f"blk.{layer}.{names.get(suffix) or _BLOCK_NAMES[suffix]}",)


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
    hybrid = arch_of(model) == "qwen35moe"
    for hf_name, param in model.state_dict().items():
        weight = param.detach().to(torch.float32).numpy()
        if (n_heads := rope_permute_heads(model, hf_name)) is not None:
            weight = permute_rope_rows(weight, n_heads)
        if hybrid:
            weight = qwen35_transform(model.config, hf_name, weight)
        names = gguf_names(hf_name, fused_gate_up=fused_gate_up, names=QWEN35_NAMES if hybrid else None)
        parts = np.split(weight, len(names), axis=1) if len(names) > 1 else [weight]  # (E, 2F, H) -> 2 x (E, F, H)
        tensors.update((name, np.ascontiguousarray(part)) for name, part in zip(names, parts))
    return tensors


def qwen35_transform(config, hf_name: str, weight: np.ndarray, inverse: bool = False) -> np.ndarray:
    """What llama.cpp's converter does to a qwen35moe tensor (or, `inverse`, undoes): HF's
    RMSNorm weights are stored with the +1 HF adds at run time (not the DeltaNet's gated norm),
    A_log as -exp(A_log), the conv weight [C, 1, W] as [C, W], and every axis over value heads
    reordered from HF's grouped order (value head c·r + j with key head c) to the tiled order
    j·HK + c."""
    if hf_name.endswith("norm.weight") and "linear_attn" not in hf_name:
        return weight - 1 if inverse else weight + 1
    if "linear_attn" not in hf_name:
        return weight
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    key_width, value_dim = key_heads * config.linear_key_head_dim, config.linear_value_head_dim

    def reorder(part: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
        groups = (value_heads // key_heads, key_heads) if inverse else (key_heads, value_heads // key_heads)
        shape = part.shape
        split = part.reshape(*shape[:axis], *groups, head_dim, *shape[axis + 1:])
        return np.swapaxes(split, axis, axis + 1).reshape(shape)

    if hf_name.endswith("conv1d.weight"):
        weight = weight.reshape(weight.shape[0], weight.shape[-1])
    if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([weight[:2 * key_width], reorder(weight[2 * key_width:], 0, value_dim)])
    if hf_name.endswith("in_proj_z.weight"):
        return reorder(weight, 0, value_dim)
    if hf_name.endswith(("in_proj_b.weight", "in_proj_a.weight", "dt_bias")):
        return reorder(weight, 0, 1)
    if hf_name.endswith("A_log"):
        return reorder(np.log(-weight), 0, 1) if inverse else -np.exp(reorder(weight, 0, 1))
    if hf_name.endswith("out_proj.weight"):
        return reorder(weight, 1, value_dim)
    return weight


def storage_type(gguf_name: str, ndim: int, ftype: str) -> gguf.GGMLQuantizationType:
    """The converter's choice: 1-D, norms, routers, the DeltaNet's conv and names not ending in
    .weight stay F32, everything else gets `ftype`."""
    if (ndim <= 1 or gguf_name.endswith("_norm.weight") or gguf_name.endswith(_F32_MATRICES)
            or not gguf_name.endswith(".weight")):
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
    if hparams.get("intermediate_size") is not None:
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
    if arch in ("qwen2moe", "qwen3moe", "qwen35moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if hparams.get("shared_expert_intermediate_size") is not None:
            writer.add_expert_shared_feed_forward_length(hparams["shared_expert_intermediate_size"])
    if dense := sorted(hparams.get("mlp_only_layers") or []):
        writer.add_leading_dense_block_count(len(dense) if dense == list(range(len(dense))) else 0)
    if arch == "qwen35moe":
        _write_qwen35_hparams(writer, config)
    if arch == "mixtral":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(hparams.get("head_dim") or config.hidden_size // config.num_attention_heads)
    writer.add_file_type(_FILE_TYPE[ftype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_qwen35_hparams(writer: gguf.GGUFWriter, config) -> None:
    """The rope's rotated dims and sections, the DeltaNet's shape and the layer pattern."""
    rope = config.rope_parameters
    writer.add_rope_dimension_count(int(config.head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_dimension_sections([*rope["mrope_section"], 0, 0, 0][:4])
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_full_attention_interval(config.to_dict().get("full_attention_interval", 4))
    writer.add_array("qwen35moe.attention.recurrent_layers",
                     [kind == "linear_attention" for kind in config.layer_types])


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
