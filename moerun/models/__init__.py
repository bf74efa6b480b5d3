"""Architecture specs: the rules of each supported GGUF architecture (rules.py), and
`load_spec`, which turns a GGUF file's metadata and tensor index into a `ModelSpec`."""
from __future__ import annotations

from moerun.gguf.reader import GGUFError, GGUFFile
from moerun.models.rules import RULES, SUPPORTED
from moerun.models.spec import DeltaNetShape, ModelSpec


def load_spec(gguf: GGUFFile) -> ModelSpec:
    """Read the hyper-parameters; raise GGUFError for anything moerun cannot run."""
    arch = gguf.require("general.architecture")
    rule = RULES.get(arch)
    if rule is None:
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
    fused = gguf.has_tensor(f"blk.{first_moe}.ffn_gate_up_exps.weight")
    down = gguf.tensor(f"blk.{first_moe}.ffn_down_exps.weight").shape  # (E, H, F)
    rope_scale = _rope_scale(gguf, arch)
    head_dim_k = int(key("attention.key_length", hidden // n_heads))
    head_dim_v = int(key("attention.value_length", hidden // n_heads))
    recurrent = _recurrent_layers(gguf, arch, n_layers)
    _check_fused_qkv(gguf, n_layers, recurrent,
                     (n_heads * head_dim_k, n_kv_heads * head_dim_k, n_kv_heads * head_dim_v))
    rope_dims = int(key("rope.dimension_count", head_dim_k))
    if rule.gguf_arch == "qwen35moe":
        _check_rope_sections(gguf, arch, rope_dims)
    return ModelSpec(
        rule=rule,
        name=str(gguf.get("general.name", gguf.path.stem)),
        n_layers=n_layers,
        hidden=hidden,
        vocab=gguf.tensor("token_embd.weight").shape[0],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        context_train=int(key("context_length")),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_scale=rope_scale,
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        n_experts=down[0],
        n_experts_used=int(key("expert_used_count")),
        expert_ff=down[2],
        shared_ff=_first_dim(gguf, "ffn_down_shexp.weight", n_layers, axis=-1),
        dense_ff=_first_dim(gguf, "ffn_down.weight", n_layers, axis=-1),
        moe_layers=moe_layers,
        fused_gate_up=fused,
        rope_dims=0 if rope_dims == head_dim_k else rope_dims,
        recurrent_layers=recurrent if any(recurrent) else (),
        delta_net=_delta_net_shape(gguf, arch) if any(recurrent) else None,
    )


def _recurrent_layers(gguf: GGUFFile, arch: str, n_layers: int) -> tuple[bool, ...]:
    """Which layers are gated DeltaNet (linear attention) rather than attention: as listed in
    `attention.recurrent_layers`, else all but every `full_attention_interval`-th."""
    listed = gguf.get(f"{arch}.attention.recurrent_layers")
    if listed is not None:
        if len(listed) < n_layers:
            raise GGUFError(gguf.path, f"'{arch}.attention.recurrent_layers' has {len(listed)} entries for "
                            f"{n_layers} layers")
        return tuple(bool(v) for v in listed[:n_layers])
    interval = gguf.get(f"{arch}.full_attention_interval")
    if interval is None:
        return (False,) * n_layers
    if int(interval) < 1:
        raise GGUFError(gguf.path, f"'{arch}.full_attention_interval' is {interval}; it must be at least 1")
    return tuple((i + 1) % int(interval) != 0 for i in range(n_layers))


def _delta_net_shape(gguf: GGUFFile, arch: str) -> DeltaNetShape:
    def key(name: str) -> int:
        value = gguf.get(f"{arch}.ssm.{name}")
        if value is None:
            raise GGUFError(gguf.path, f"missing metadata key '{arch}.ssm.{name}' (the linear attention layers' shape)")
        return int(value)

    key_heads, value_heads = key("group_count"), key("time_step_rank")
    if key_heads < 1 or value_heads % key_heads:
        raise GGUFError(gguf.path, f"'{arch}.ssm.time_step_rank' ({value_heads} value heads) must be a multiple of "
                        f"'{arch}.ssm.group_count' ({key_heads} key heads)")
    inner = key("inner_size")
    if inner % value_heads:
        raise GGUFError(gguf.path, f"'{arch}.ssm.inner_size' ({inner}) is not a multiple of {value_heads} value heads")
    return DeltaNetShape(key_heads=key_heads, value_heads=value_heads, key_dim=key("state_size"),
                         value_dim=inner // value_heads, conv_kernel=key("conv_kernel"))


def _check_rope_sections(gguf: GGUFFile, arch: str, rope_dims: int) -> None:
    """qwen35moe's rope is multi-section (time, height, width, extra); for text, whose positions
    are equal on the first three and 0 on the fourth, it is plain NEOX rope only if every rotated
    pair takes one of the first three sections (as in llama.cpp's sector rule)."""
    sections = [int(v) for v in gguf.get(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])]
    time, height, width = (sections + [0, 0, 0])[:3]
    total = sum(sections)
    for pair in range(rope_dims // 2):
        sector = pair % total if total else pair
        if not ((sector % 3 == 0 and sector < 3 * time) or (sector % 3 == 1 and sector < 3 * height)
                or (sector % 3 == 2 and sector < 3 * width)):
            raise GGUFError(gguf.path, f"'{arch}.rope.dimension_sections' {sections} leave rotated pair {pair} to the "
                            f"fourth section, which text positions do not use; moerun runs text only")


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


def _check_fused_qkv(gguf: GGUFFile, n_layers: int, recurrent: tuple[bool, ...], widths: tuple[int, int, int]) -> None:
    """An attention layer's fused attn_qkv (llama.cpp's converter with --fuse-qkv) stands instead
    of attn_q/k/v, weights and biases alike, and holds the q, k and v rows in that order: the
    forward pass splits it by these widths. (A DeltaNet layer's attn_qkv is its own projection.)"""
    rows = sum(widths)
    for i in range(n_layers):
        if recurrent[i]:
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
