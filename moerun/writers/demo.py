"""The built-in demo model `moerun run` and `moerun serve` use when no -m is given: made
deterministically on first use in the user's cache directory."""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from moerun.paths import cache_dir
from moerun.writers.synthetic import SyntheticConfig, write_synthetic_model

DEMO_CONFIG = SyntheticConfig(name="moerun-demo-moe", weight_std=0.01)
FORMAT_VERSION = 2
DESCRIPTION = (
    "moerun's built-in demo model: a tiny 4-layer qwen3moe (8 experts, top-2, Q8_0) "
    "with random attention and expert weights and an output head that holds the word-pair "
    "statistics of a short built-in text. It runs the whole MoE pipeline, but it is not a "
    "language model: its text only echoes that built-in text. Pass -m MODEL.gguf for a real one."
)


def demo_model_path() -> Path:
    """Path of the demo model, written there first if it is not there yet."""
    path = cache_dir() / f"demo-moe-v{FORMAT_VERSION}.gguf"
    if not path.exists():
        write_synthetic_model(path, DEMO_CONFIG, demo_corpus(), bigram_head=True)
    return path


def demo_corpus() -> str:
    """The short built-in text the demo model's vocabulary and word-pair head come from."""
    return files("moerun.writers").joinpath("demo_corpus.txt").read_text(encoding="utf-8")
