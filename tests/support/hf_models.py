"""Tiny random Hugging Face MoE models, one per supported architecture.

Every width is a multiple of 32 so each matrix can be stored as Q8_0 / Q4_0.
Routing follows what llama.cpp hard-codes per architecture: qwen3moe and
mixtral renormalise the top-K weights, qwen2moe and olmoe do not.

Dense layers: llama.cpp's qwen2moe / qwen3moe tensor lists have no dense
`ffn_gate/ffn_up/ffn_down`, so its converter cannot write `mlp_only_layers`;
files of architectures that have them (leading dense blocks) name them
`blk.N.ffn_{gate,up,down}.weight` with `{arch}.leading_dense_block_count`, and
to_gguf writes qwen2moe/qwen3moe `mlp_only_layers` that way so the engine's
dense-layer path has an oracle. olmoe and mixtral have no dense-layer option.
"""
from __future__ import annotations

import torch
import transformers

ARCHS = ("qwen3moe", "qwen2moe", "olmoe", "mixtral")
HYBRID_ARCHS = ("qwen35moe",)     # gated DeltaNet layers and gated attention

WEIGHT_STD = 0.15
ROUTER_STD = 0.3          # sharper than WEIGHT_STD: routing must be far from uniform
NORM_JITTER = 0.1         # norm weights 1 ± this, biases N(0, this)

_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

_PER_ARCH = {
    "qwen3moe": (transformers.Qwen3MoeConfig, dict(
        head_dim=32,                  # q_proj (128, 64): head_dim decoupled from hidden / heads
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=96,         # dense width, unused without dense layers
        norm_topk_prob=True,
    )),
    "qwen2moe": (transformers.Qwen2MoeConfig, dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
        intermediate_size=96,
        norm_topk_prob=False,
        qkv_bias=True,
    )),
    "olmoe": (transformers.OlmoeConfig, dict(
        num_experts=8,
        num_experts_per_tok=3,
        intermediate_size=64,         # olmoe's expert width
        norm_topk_prob=False,
        rms_norm_eps=1e-5,            # llama.cpp's converter writes 1e-5 for olmoe whatever the config says
    )),
    "mixtral": (transformers.MixtralConfig, dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=64,         # mixtral's expert width
    )),
    "qwen35moe": (transformers.Qwen3_5MoeTextConfig, dict(
        num_hidden_layers=4,
        full_attention_interval=4,    # layers 0-2 gated DeltaNet, 3 gated attention
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},   # rope over 8 of 32 dims
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,     # two value heads a key head: the converter reorders them
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    )),
}


def tiny_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    """The tiny config of `arch` (one of ARCHS or HYBRID_ARCHS), with `overrides` applied last."""
    config_class, arch_kwargs = _PER_ARCH[arch]
    return config_class(**{**_COMMON, **arch_kwargs, **overrides})


def tiny_model(arch: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A float32 model in eval mode with seeded weights that route far from uniformly."""
    config = tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    offset_norms = config.model_type == "qwen3_5_moe_text"      # its RMSNorms scale by 1 + weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_random_like(name, param, generator, offset_norms and "linear_attn" not in name))
    return model


def _random_like(name: str, param: torch.Tensor, generator: torch.Generator, offset_norm: bool = False) -> torch.Tensor:
    noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
    if param.ndim == 1 and name.endswith("norm.weight"):
        return (0.0 if offset_norm else 1.0) + NORM_JITTER * noise
    if param.ndim == 1:
        return NORM_JITTER * noise
    if name.endswith("mlp.gate.weight"):
        return ROUTER_STD * noise
    return WEIGHT_STD * noise
