"""`python -m moerun` works wherever a user runs it, the checkout's root included: there the
checkout's moerun/ folder is imported instead of the installed package, and moerun.ipc and
moerun.daemons must still be found (pyproject maps them from ipc/ and daemons/)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

REPO = Path(__file__).resolve().parents[2]
SITE_PACKAGES = Path(numpy.__file__).parents[1]


@pytest.mark.parametrize("where", ["checkout root", "elsewhere"])
def test_python_dash_m_moerun_runs_a_command(tmp_path, where):
    # -S: no site processing, so no editable-install finder: `moerun` is whatever sys.path finds
    # first, the working directory's folder in the checkout root (as after `pip install .`)
    env = {**os.environ, "PYTHONPATH": str(SITE_PACKAGES) if where == "checkout root" else f"{REPO}:{SITE_PACKAGES}",
           "MOERUN_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-S", "-m", "moerun", "inspect"], cwd=REPO if where == "checkout root"
                            else tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "KV cache per token" in result.stdout
