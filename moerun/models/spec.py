"""ModelSpec: the hyper-parameters and per-architecture rules one forward pass needs.

Built from GGUF metadata and the tensor index by `moerun.models.load_spec`; each
architecture contributes only the rules that differ (rope style, routing; rules.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchRule:
    """What distinguishes one architecture family in the forward pass."""

    family: str              # qwen3moe | qwen2moe | olmoe | mixtral
    gguf_arch: str           # general.architecture value
    rope_style: str          # "neox" (rotate halves) or "norm" (rotate adjacent pairs)
    renormalize_topk: bool   # rescale the top-K router weights to sum to 1
    gated_shared_expert: bool = False  # shared expert scaled by sigmoid(ffn_gate_inp_shexp · x)


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

    @property
    def family(self) -> str:
        return self.rule.family

    def expert_tensor_names(self, layer: int) -> list[str]:
        """The GGUF tensors of one layer's routed experts: gate, up, down (E, F, H / E, H, F),
        or the fused gate_up (E, 2F, H, gate first) and down."""
        parts = ("gate_up", "down") if self.fused_gate_up else ("gate", "up", "down")
        return [f"blk.{layer}.ffn_{part}_exps.weight" for part in parts]
