"""A GPU device without CuPy names the install commands to paste, each an extra pyproject defines."""
from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from moerun.backends.devices import BackendUnavailable, gpu_module, parse_device

EXTRAS = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
    "optional-dependencies"]


@pytest.mark.parametrize("device, extras", [("cuda:0", ["cuda12", "cuda13"]), ("hip:0", ["rocm"])])
def test_missing_cupy_names_pasteable_install_commands(monkeypatch, device, extras):
    monkeypatch.setitem(sys.modules, "cupy", None)          # import cupy raises ImportError
    with pytest.raises(BackendUnavailable) as error:
        gpu_module(parse_device(device))
    named = re.findall(r"pip install 'moerun\[([^\]]+)\]'", str(error.value))
    assert named == extras and all(extra in EXTRAS for extra in named)
