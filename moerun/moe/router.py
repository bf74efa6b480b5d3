"""Top-K expert selection, as llama.cpp does it for each architecture.

Shape legend: T tokens, E experts, K experts per token.
"""
from __future__ import annotations

import numpy as np

from moerun.backends.numpy_ops import softmax


def route(router_logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """router_logits [T, E] -> expert ids [T, K] (int64, best first), weights [T, K] f32.

    Softmax over all E experts, keep the K most probable; `renormalize` rescales
    the kept weights to sum to 1 (qwen3moe, Mixtral), otherwise they are the raw
    probabilities (qwen2moe, olmoe).
    """
    probs = softmax(router_logits.astype(np.float32), axis=-1)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if renormalize:
        weights = weights / np.sum(weights, axis=-1, keepdims=True)
    return ids, weights.astype(np.float32)
