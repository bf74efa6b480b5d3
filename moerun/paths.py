"""Where moerun keeps the files it makes for itself: the demo model, the compiled CPU kernels."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$MOERUN_CACHE, else $XDG_CACHE_HOME/moerun, else ~/.cache/moerun."""
    if os.environ.get("MOERUN_CACHE"):
        return Path(os.environ["MOERUN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moerun"
