"""`moerun inspect`: what a GGUF MoE model is and how its bytes are spread."""
from __future__ import annotations

from collections import Counter

import click

from moerun.backends.kv_types import KVTypes
from moerun.commands.options import friendly_errors, model_or_demo
from moerun.gguf.reader import GGUFFile
from moerun.models import load_spec
from moerun.models.spec import ModelSpec
from moerun.moe.planner import model_sizes


@click.command()
@click.argument("model", type=click.Path(dir_okay=False), required=False)
@friendly_errors
def inspect(model):
    """Print the architecture, hyper-parameters, tensor types and sizes of a GGUF model
    [default: the built-in demo model]."""
    click.echo(describe(model_or_demo(model)))


def describe(path) -> str:
    with GGUFFile(path) as gguf:
        spec = load_spec(gguf)
        lines = [f"file:          {gguf.path} (GGUF v{gguf.version}, {_size(gguf.path.stat().st_size)})"]
        lines += _hyperparameters(spec, _gated_attention(gguf, spec))
        lines += ["", "tensor types:"] + _tensor_types(gguf)
        lines += ["", "per layer:"] + _layers(gguf, spec)
        sizes = model_sizes(gguf, spec)
        kv = {name: _size(sizes.kv_token_bytes(KVTypes(name, name))) for name in ("f16", "f32", "q8_0", "q4_0")}
        lines += ["", f"KV cache per token: {kv['f16']} at f16, {kv['f32']} at f32, {kv['q8_0']} at q8_0, "
                      f"{kv['q4_0']} at q4_0 "
                      + (f"(all {spec.n_layers} layers)" if spec.attention_layers == spec.n_layers else
                         f"(its {spec.attention_layers} of {spec.n_layers} layers with attention; a DeltaNet "
                         f"layer keeps fixed states instead)")]
    return "\n".join(lines)


def _hyperparameters(spec: ModelSpec, gated_attention: bool) -> list[str]:
    dense = [i for i, moe in enumerate(spec.moe_layers) if not moe]
    rows = [
        ("architecture", f"{spec.family} (rope {spec.rule.rope_style}, top-K weights "
                         f"{'renormalised' if spec.rule.renormalize_topk else 'not renormalised'})"),
        ("name", spec.name),
        ("layers", f"{spec.n_layers} ({len(dense)} dense: {dense})" if dense else str(spec.n_layers)),
        ("hidden", spec.hidden),
        ("heads", f"{spec.n_heads} query, {spec.n_kv_heads} key/value, head dim {spec.head_dim_k}"
                  + (f", rope over {spec.rope_dims}" if spec.rope_dims else "")
                  + (", gated output" if gated_attention else "")),
        *([("DeltaNet", _delta_net(spec))] if spec.delta_net else []),
        ("experts", f"{spec.n_experts}, {spec.n_experts_used} per token, FFN width {spec.expert_ff}"
                    + (", gate+up fused" if spec.fused_gate_up else "")),
        ("shared expert", f"FFN width {spec.shared_ff}" if spec.shared_ff else "none"),
        ("dense FFN", f"width {spec.dense_ff}" if spec.dense_ff else "none"),
        ("vocab", spec.vocab),
        ("context", spec.context_train),
        ("rope base", f"{spec.rope_base:g}" + (f", linear scale {spec.rope_scale:g}" if spec.rope_scale != 1 else "")),
        ("rms eps", f"{spec.rms_eps:g}"),
    ]
    return [f"{key + ':':<15}{value}" for key, value in rows]


def _gated_attention(gguf: GGUFFile, spec: ModelSpec) -> bool:
    """Whether attn_q holds each head's output gate too (twice the query rows)."""
    first = next(i for i in range(spec.n_layers) if not spec.is_recurrent(i))
    q = f"blk.{first}.attn_q.weight"
    return gguf.has_tensor(q) and gguf.tensor(q).shape[0] == 2 * spec.n_heads * spec.head_dim_k


def _delta_net(spec: ModelSpec) -> str:
    shape, attention = spec.delta_net, [i for i in range(spec.n_layers) if not spec.is_recurrent(i)]
    return (f"{spec.n_layers - len(attention)} layers (attention in {attention}), {shape.key_heads} key and "
            f"{shape.value_heads} value heads of {shape.key_dim}/{shape.value_dim}, conv {shape.conv_kernel}")


def _tensor_types(gguf: GGUFFile) -> list[str]:
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for info in gguf.tensors.values():
        counts[info.ggml_type.name] += 1
        sizes[info.ggml_type.name] += info.nbytes
    return [f"  {name:<8}{counts[name]:>6} tensors {_size(sizes[name]):>12}" for name in sorted(counts)]


def _layers(gguf: GGUFFile, spec: ModelSpec) -> list[str]:
    lines = [f"  {'layer':>5} {'kind':<6} {'total':>12} {'experts':>12} {'per expert':>12} {'other':>12}"]
    for i in range(spec.n_layers):
        tensors = [t for name, t in gguf.tensors.items() if name.startswith(f"blk.{i}.")]
        expert_bytes = sum(t.nbytes for t in tensors if t.name.endswith("_exps.weight"))
        total = sum(t.nbytes for t in tensors)
        per_expert = _size(expert_bytes // spec.n_experts) if spec.moe_layers[i] else "-"
        kind = "moe" if spec.moe_layers[i] else "dense"
        lines.append(f"  {i:>5} {kind:<6} {_size(total):>12} {_size(expert_bytes):>12} {per_expert:>12} "
                     f"{_size(total - expert_bytes):>12}")
    return lines


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.2f} {unit}"
