"""Fuse a GGUF file's attention projections as llama.cpp's converter does with --fuse-qkv:
per layer, attn_q, attn_k and attn_v (weights, and biases where the layer has them) become one
attn_qkv with the q rows first, then k, then v. Stored bytes are kept as they are (a quantized
row is whole blocks), so a file of any type can be fused without the converter."""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

_PART = re.compile(r"blk\.(\d+)\.attn_([qkv])\.(weight|bias)")


def fuse_qkv(src: Path, dst: Path, keep: tuple[str, ...] = ()) -> Path:
    """A copy of `src` at `dst` with every layer's q, k and v fused into attn_qkv; the tensors
    named in `keep` stay as well (to make files that are wrong)."""
    reader = gguf.GGUFReader(src)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for name, tensor in tensors.items():
        match = _PART.fullmatch(name)
        if match is None or name in keep:
            writer.add_tensor(name, tensor.data, raw_dtype=tensor.tensor_type)
        if match is not None and match[2] == "q":         # the fused tensor takes attn_q's place
            layer, suffix = match[1], match[3]
            parts = [tensors.get(f"blk.{layer}.attn_{p}.{suffix}") for p in "qkv"]
            if any(part is None or part.tensor_type != tensor.tensor_type for part in parts):
                raise ValueError(f"layer {layer}: the q, k and v {suffix}s differ in presence or type")
            writer.add_tensor(f"blk.{layer}.attn_qkv.{suffix}", np.concatenate([p.data for p in parts]),
                              raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
