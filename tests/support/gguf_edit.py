"""Copy a GGUF file with changes, to make broken or unusual models for tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf


def rewrite_gguf(src: Path, dst: Path, *, drop_tensors: tuple[str, ...] = (), drop_keys: tuple[str, ...] = (),
                 set_strings: dict[str, str] | None = None, set_uint32: dict[str, int] | None = None,
                 set_arrays: dict[str, list] | None = None,
                 set_tensors: dict[str, tuple[Any, gguf.GGMLQuantizationType]] | None = None) -> Path:
    """set_tensors: name -> (data as gguf.GGUFWriter.add_tensor takes it, its type), replacing
    that tensor's data and type."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    strings = dict(set_strings or {})
    writer = gguf.GGUFWriter(dst, arch=strings.pop("general.architecture", arch))
    for key, field in reader.fields.items():
        if (key.startswith("GGUF.") or key in drop_keys or key == "general.architecture" or key in strings
                or key in (set_uint32 or {}) or key in (set_arrays or {})):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value: Any = field.contents()
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for key, value in strings.items():
        writer.add_string(key, value)
    for key, value in (set_uint32 or {}).items():
        writer.add_uint32(key, value)
    for key, values in (set_arrays or {}).items():
        writer.add_array(key, values)
    replaced = set_tensors or {}
    for tensor in reader.tensors:
        if tensor.name not in drop_tensors:
            data, ggml_type = replaced.get(tensor.name, (tensor.data, tensor.tensor_type))
            writer.add_tensor(tensor.name, data, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
