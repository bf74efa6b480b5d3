"""Writing GGUF metadata from plain Python and numpy values."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np


def write_metadata(writer: gguf.GGUFWriter, meta: Mapping[str, Any]) -> None:
    """Write plain Python/numpy metadata values with their natural GGUF types."""
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, (int, np.integer)):
            writer.add_uint32(key, int(value)) if value >= 0 else writer.add_int32(key, int(value))
        elif isinstance(value, (float, np.floating)):
            writer.add_float32(key, float(value))
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, np.ndarray):
            writer.add_array(key, value.tolist())
        else:
            writer.add_array(key, list(value))
