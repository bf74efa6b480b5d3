"""Architecture specs: `load_spec`, which turns a GGUF file's metadata and tensor index into a
`ModelSpec`, from the keys every architecture has and what its module (registry.py) reads."""
from __future__ import annotations

from moerun.gguf.reader import GGUFError, GGUFFile
from moerun.models.registry import ARCHITECTURES, SUPPORTED
from moerun.models.spec import ModelSpec


def load_spec(gguf: GGUFFile) -> ModelSpec:
    """Read the hyper-parameters; raise GGUFError for anything moerun cannot run."""
    arch = gguf.require("general.architecture")
    module = ARCHITECTURES.get(arch)
    if module is None:
        raise GGUFError(gguf.path, f"unsupported architecture '{arch}' (moerun runs {SUPPORTED})")

    def key(name: str, default=None):
        value = gguf.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(gguf.path, f"missing metadata key '{arch}.{name}'")
        return value

    n_layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))    # trunk; next-token heads unused
    moe_layers = tuple(gguf.has_tensor(f"blk.{i}.ffn_gate_inp.weight") for i in range(n_layers))
    if not any(moe_layers):
        raise GGUFError(gguf.path, f"'{arch}' model has no expert layers: moerun runs mixture-of-experts models only")
    _check_dense_layout(gguf, arch, moe_layers)

    hidden = int(key("embedding_length"))
    n_heads = _uniform(gguf, arch, "attention.head_count", key("attention.head_count"))
    n_kv_heads = _uniform(gguf, arch, "attention.head_count_kv", key("attention.head_count_kv", n_heads))
    first_moe = moe_layers.index(True)
    down = gguf.tensor(f"blk.{first_moe}.ffn_down_exps.weight").shape  # (E, H, F)
    head_dim_k = int(key("attention.key_length", hidden // n_heads))
    rope_dims = int(key("rope.dimension_count", head_dim_k))
    spec = module.read_spec(gguf, ModelSpec(
        rule=module.RULE,
        name=str(gguf.get("general.name", gguf.path.stem)),
        n_layers=n_layers,
        hidden=hidden,
        vocab=gguf.tensor("token_embd.weight").shape[0],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim_k=head_dim_k,
        head_dim_v=int(key("attention.value_length", hidden // n_heads)),
        context_train=int(key("context_length")),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_scale=_rope_scale(gguf, arch),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        n_experts=down[0],
        n_experts_used=int(key("expert_used_count")),
        expert_ff=down[2],
        shared_ff=_first_dim(gguf, "ffn_down_shexp.weight", n_layers, axis=-1),
        dense_ff=_first_dim(gguf, "ffn_down.weight", n_layers, axis=-1),
        moe_layers=moe_layers,
        fused_gate_up=gguf.has_tensor(f"blk.{first_moe}.ffn_gate_up_exps.weight"),
        rope_dims=0 if rope_dims == head_dim_k else rope_dims,
    ))
    _check_fused_qkv(gguf, spec)
    return spec


def _uniform(gguf: GGUFFile, arch: str, name: str, value) -> int:
    """Head counts may be stored per layer; moerun needs them equal across layers."""
    if isinstance(value, (int, float)):
        return int(value)
    values = {int(v) for v in value}
    if len(values) != 1:
        raise GGUFError(gguf.path, f"'{arch}.{name}' varies across layers ({sorted(values)}); not supported")
    return values.pop()


def _check_dense_layout(gguf: GGUFFile, arch: str, moe_layers: tuple[bool, ...]) -> None:
    leading = int(gguf.get(f"{arch}.leading_dense_block_count", 0))
    if any(moe_layers[:leading]):
        raise GGUFError(gguf.path, f"'{arch}.leading_dense_block_count' is {leading} but layer "
                        f"{moe_layers.index(True)} has expert tensors")
    for i, is_moe in enumerate(moe_layers):
        if not is_moe and not gguf.has_tensor(f"blk.{i}.ffn_down.weight"):
            raise GGUFError(gguf.path, f"layer {i} has neither expert tensors (blk.{i}.ffn_gate_inp.weight) "
                            f"nor a dense FFN (blk.{i}.ffn_down.weight)")


def _check_fused_qkv(gguf: GGUFFile, spec: ModelSpec) -> None:
    """An attention layer's fused attn_qkv (llama.cpp's converter with --fuse-qkv) stands instead
    of attn_q/k/v, weights and biases alike, and holds the q, k and v rows in that order: the
    forward pass splits it by these widths. (A DeltaNet layer's attn_qkv is its own projection.)"""
    widths = (spec.n_heads * spec.head_dim_k, spec.n_kv_heads * spec.head_dim_k, spec.n_kv_heads * spec.head_dim_v)
    rows = sum(widths)
    for i in range(spec.n_layers):
        if spec.is_recurrent(i):
            continue
        weight, bias = f"blk.{i}.attn_qkv.weight", f"blk.{i}.attn_qkv.bias"
        if not gguf.has_tensor(weight):
            if gguf.has_tensor(bias):
                raise GGUFError(gguf.path, f"'{bias}' without '{weight}'")
            continue
        separate = [name for p in "qkv" for suffix in ("weight", "bias")
                    if gguf.has_tensor(name := f"blk.{i}.attn_{p}.{suffix}")]
        if separate:
            raise GGUFError(gguf.path, f"layer {i} has both '{weight}' and '{separate[0]}'")
        for name in (weight, bias):
            if gguf.has_tensor(name) and gguf.tensor(name).shape[0] != rows:
                raise GGUFError(gguf.path, f"'{name}' has {gguf.tensor(name).shape[0]} rows; q, k and v need "
                                f"{' + '.join(map(str, widths))} = {rows} (from attention.head_count, "
                                f"head_count_kv, key_length and value_length)")


def _first_dim(gguf: GGUFFile, suffix: str, n_layers: int, axis: int) -> int:
    for i in range(n_layers):
        name = f"blk.{i}.{suffix}"
        if gguf.has_tensor(name):
            return gguf.tensor(name).shape[axis]
    return 0


def _rope_scale(gguf: GGUFFile, arch: str) -> float:
    """Linear position scaling factor; other rope scaling schemes are refused clearly."""
    kind = gguf.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return float(gguf.get(f"{arch}.rope.scale_linear", 1.0))
    if kind == "linear":
        return float(gguf.get(f"{arch}.rope.scaling.factor", 1.0))
    raise GGUFError(gguf.path, f"rope scaling '{kind}' is not supported yet (moerun supports none and linear)")
