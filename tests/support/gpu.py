"""What the GPU tests share: whether a GPU is here, and a small ModelSpec to build a backend."""
from __future__ import annotations

from moerun.models.spec import ArchRule, ModelSpec

# Relative logit error ‖gpu - numpy‖ / ‖numpy‖ of the GEMV path (chunks of <= 8 tokens, decode):
FLOAT_GEMV_BOUND = 1e-5       # float weights (F32, F16, BF16): f32 products
INT_GEMV_BOUND = 3e-4         # quantized weights: activations in two 8-bit planes (4e-5..1.3e-4 on an H100)


def gemv_bound(ftype: str) -> float:
    return FLOAT_GEMV_BOUND if ftype in ("F32", "F16", "BF16") else INT_GEMV_BOUND


def gpu_device() -> str | None:
    """cuda:0 or hip:0 when CuPy sees a GPU, else None."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:  # noqa: BLE001 - no usable GPU, whatever the reason
        return None
    return "hip:0" if cupy.cuda.runtime.is_hip else "cuda:0"


def small_spec(hidden: int = 256, experts: int = 8, top_k: int = 2, expert_ff: int = 128) -> ModelSpec:
    rule = ArchRule(family="qwen3moe", gguf_arch="qwen3moe", rope_style="neox", renormalize_topk=True)
    return ModelSpec(rule=rule, name="kernel-test", n_layers=1, hidden=hidden, vocab=512, n_heads=4,
                     n_kv_heads=2, head_dim_k=64, head_dim_v=64, context_train=1024, rope_base=10000.0,
                     rope_scale=1.0, rms_eps=1e-6, n_experts=experts, n_experts_used=top_k, expert_ff=expert_ff,
                     shared_ff=0, dense_ff=0, moe_layers=(True,), fused_gate_up=False)


def gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no usable GPU, whatever the reason
        return 0
