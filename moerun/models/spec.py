"""ModelSpec: the hyper-parameters one forward pass needs, and the architecture's rule.

Built from GGUF metadata and the tensor index by `moerun.models.load_spec`; each
architecture (its file in moerun/models/) declares its rule and what it reads beyond the
common keys.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchRule:
    """What the backends' operations read of an architecture (rope_append, route); the rest of
    it is how its file composes a layer."""

    family: str              # qwen3moe | qwen2moe | olmoe | mixtral | qwen35moe
    gguf_arch: str           # general.architecture value
    rope_style: str          # "neox" (rotate halves) or "norm" (rotate adjacent pairs)
    renormalize_topk: bool   # rescale the top-K router weights to sum to 1


@dataclass(frozen=True)
class DeltaNetShape:
    """The gated DeltaNet (linear attention) layers of a hybrid model: HK key heads of DK,
    HV value heads of DV (HV a multiple of HK; value head g reads key head g % HK), a causal
    depthwise convolution of `conv_kernel` over the q, k and v channels (C = 2·HK·DK + HV·DV)."""
    key_heads: int           # HK
    value_heads: int         # HV
    key_dim: int             # DK
    value_dim: int           # DV
    conv_kernel: int

    @property
    def channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class ModelSpec:
    rule: ArchRule
    name: str
    n_layers: int            # L
    hidden: int              # H
    vocab: int               # V
    n_heads: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    context_train: int
    rope_base: float
    rope_scale: float        # linear position scaling (1.0 = none)
    rms_eps: float
    n_experts: int           # E
    n_experts_used: int      # K
    expert_ff: int           # F
    shared_ff: int           # shared expert width (0 = none)
    dense_ff: int            # width of dense FFN layers (0 = none)
    moe_layers: tuple[bool, ...]  # per layer: True = routed experts, False = dense FFN
    fused_gate_up: bool      # experts stored as ffn_gate_up_exps (E, 2F, H), gate first
    rope_dims: int = 0       # the leading dims of a head that rope rotates (0: all of head_dim_k)
    recurrent_layers: tuple[bool, ...] = ()   # per layer: True = gated DeltaNet instead of attention
    delta_net: DeltaNetShape | None = None

    @property
    def rotary_dims(self) -> int:
        return self.rope_dims or self.head_dim_k

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    @property
    def attention_layers(self) -> int:
        """Layers with a KV cache."""
        return self.n_layers - sum(self.recurrent_layers)

    @property
    def family(self) -> str:
        return self.rule.family

    def expert_tensor_names(self, layer: int) -> list[str]:
        """The GGUF tensors of one layer's routed experts: gate, up, down (E, F, H / E, H, F),
        or the fused gate_up (E, 2F, H, gate first) and down."""
        parts = ("gate_up", "down") if self.fused_gate_up else ("gate", "up", "down")
        return [f"blk.{layer}.ffn_{part}_exps.weight" for part in parts]


def common_keys_only(gguf, spec: ModelSpec) -> ModelSpec:
    """The `read_spec` of an architecture that reads nothing beyond the common keys."""
    return spec
