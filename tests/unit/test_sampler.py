"""The sampler against direct computations of each rule on small distributions."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.engine.sampler import Sampler, SamplingParams, apply_penalties

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))


def draw(params: SamplingParams, logits=LOGITS, history=(), n: int = 4000) -> np.ndarray:
    sampler = Sampler(params)
    return np.array([sampler(logits, list(history)) for _ in range(n)])


def frequencies(samples: np.ndarray, size: int = len(LOGITS)) -> np.ndarray:
    return np.bincount(samples, minlength=size) / len(samples)


def test_greedy_takes_argmax_whatever_the_seed():
    logits = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    for seed in range(3):
        assert Sampler(SamplingParams(temperature=0.0, seed=seed))(logits, []) == int(np.argmax(logits))


def test_plain_sampling_follows_softmax():
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    np.testing.assert_allclose(frequencies(draw(params, n=20000)), np.exp(LOGITS), atol=0.015)


def test_temperature_sharpens():
    params = SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0, seed=2)
    expected = np.exp(LOGITS / 0.5) / np.exp(LOGITS / 0.5).sum()
    np.testing.assert_allclose(frequencies(draw(params, n=20000)), expected, atol=0.015)


def test_top_k_keeps_only_k_best():
    samples = draw(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=3))
    assert set(samples) == {0, 1}
    np.testing.assert_allclose(frequencies(samples)[:2], [0.5 / 0.7, 0.2 / 0.7], atol=0.03)


def test_top_p_keeps_smallest_set_reaching_p():
    # cumulative 0.5, 0.7, 0.85: p = 0.8 keeps the first three tokens
    samples = draw(SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0, seed=4))
    assert set(samples) == {0, 1, 2}


def test_min_p_drops_tokens_below_fraction_of_best():
    # 0.28 * 0.5 = 0.14 keeps probabilities >= 0.14: tokens 0, 1, 2
    samples = draw(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.28, seed=5))
    assert set(samples) == {0, 1, 2}


def test_seed_reproduces_and_differs():
    params = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = draw(SamplingParams(**params, seed=7), n=200)
    b = draw(SamplingParams(**params, seed=7), n=200)
    c = draw(SamplingParams(**params, seed=8), n=200)
    assert (a == b).all() and not (a == c).all()


def test_repetition_penalty_scales_seen_logits():
    logits = np.array([2.0, 1.9, -1.0, -1.1], dtype=np.float32)
    greedy = SamplingParams(temperature=0.0, repeat_penalty=1.5)
    assert Sampler(greedy)(logits, [0]) == 1             # 2.0 / 1.5 < 1.9
    assert Sampler(greedy)(logits, [5 % 4]) == 0         # token 1 penalised instead
    # negative logits are multiplied: -1.0 * 1.5 = -1.5 < -1.1
    only_negative = np.array([-1.0, -1.1], dtype=np.float32)
    assert Sampler(greedy)(only_negative, [0]) == 1


def test_repeat_last_n_limits_the_window():
    logits = np.array([2.0, 1.9], dtype=np.float32)
    params = SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=1)
    assert Sampler(params)(logits, [0, 1]) == 0          # only token 1 is in the window


def test_presence_penalty_counts_a_seen_token_once():
    logits = np.array([2.0, 1.5, 1.0], dtype=np.float32)
    params = SamplingParams(temperature=0.0, presence_penalty=0.6)
    assert Sampler(params)(logits, [0]) == 1             # 2.0 - 0.6 < 1.5
    assert Sampler(params)(logits, [0, 0, 0]) == 1       # still 1.4: presence, not count
    assert Sampler(params)(logits, [0, 1]) == 0          # both lowered alike


def test_frequency_penalty_grows_with_the_count():
    logits = np.array([2.0, 1.5, 1.0], dtype=np.float32)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    assert Sampler(params)(logits, [0]) == 0             # 1.7 > 1.5
    assert Sampler(params)(logits, [0, 0]) == 1          # 1.4 < 1.5
    negative = SamplingParams(temperature=0.0, frequency_penalty=-0.3)
    assert Sampler(negative)(logits, [2, 2, 2, 2]) == 2  # a negative penalty favours what was seen


def llama_cpp_penalties(logits, window, repeat, frequency, presence):
    """llama.cpp's llama_sampler_penalties_apply, token by token."""
    out = logits.copy()
    for token in set(window):
        count = window.count(token)
        out[token] = out[token] * repeat if out[token] <= 0 else out[token] / repeat
        out[token] -= count * frequency + presence
    return out


@pytest.mark.parametrize("seed", range(5))
def test_penalties_match_llama_cpp(seed):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(50).astype(np.float32) * 3
    history = [int(t) for t in rng.integers(0, 50, 120)]
    params = SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=64, presence_penalty=0.4,
                            frequency_penalty=0.2)
    expected = llama_cpp_penalties(logits, history[-64:], 1.3, 0.2, 0.4)
    assert Sampler(params)(logits, history) == int(np.argmax(expected))
    np.testing.assert_allclose(apply_penalties(logits, history[-64:], params), expected, rtol=1e-6)


@pytest.mark.parametrize("bad", [dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1),
                                 dict(repeat_penalty=0.0), dict(repeat_last_n=-1), dict(presence_penalty=2.5),
                                 dict(frequency_penalty=-3.0)])
def test_invalid_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
