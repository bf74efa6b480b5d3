"""What commands write: the stats table and JSON, and result files written atomically."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import click
import numpy as np

from moerun.engine.report import stats_table


def report_stats(document: dict, show: bool, json_path: str | None) -> None:
    """The stats table on stderr (show), the same as JSON in json_path (if given)."""
    if show:
        click.echo(stats_table(document), err=True)
    if json_path:
        write_atomic(Path(json_path), json.dumps(document, indent=2).encode() + b"\n")


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def write_atomic(path: Path, data: bytes) -> None:
    """Write a regular file through a temp file beside it and a rename, so a full disk
    never leaves a torn file; write devices and pipes (/dev/stdout) directly."""
    if path.exists() and not path.is_file():
        with path.open("wb") as stream:
            stream.write(data)
        return
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
