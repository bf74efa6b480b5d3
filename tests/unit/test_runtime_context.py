"""generate() going on from a Context (what `moerun bench -d` measures after): the tokens of a
full prefill of the same sequence, only the prompt's own tokens prefilled in the timed part,
the context's state unchanged by its use, and clear errors."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.engine.runtime import RequestError, RunStats, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.writers.bench_model import MIXES, PRESETS, with_layers, write_bench_model
from tests.support.forward_calls import record_forward_calls

GREEDY = SamplingParams(temperature=0.0)
RNG = np.random.default_rng(5)
DEPTH, PROMPT = RNG.integers(0, 256, 21).tolist(), RNG.integers(0, 256, 6).tolist()


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    path = write_bench_model(tmp_path_factory.mktemp("context") / "tiny.gguf", with_layers(PRESETS["tiny"], 2),
                             MIXES["q4_k_m"])
    with Runtime(path, ctx=64, ubatch=8) as runtime:
        yield runtime


def test_going_on_from_a_context_gives_the_full_prefills_tokens(runtime):
    want = list(runtime.generate(DEPTH + PROMPT, 8, GREEDY))
    context = runtime.context(DEPTH)
    assert context.tokens == tuple(DEPTH) and context.state is not None
    assert list(runtime.generate(PROMPT, 8, GREEDY, context=context)) == want
    assert list(runtime.generate(PROMPT, 8, GREEDY, context=context)) == want     # its state is restored anew


def test_only_the_prompt_is_prefilled_after_a_context(runtime, monkeypatch):
    context = runtime.context(DEPTH)
    calls = record_forward_calls(monkeypatch)
    stats = RunStats()
    assert len(list(runtime.generate(PROMPT, 3, GREEDY, stats=stats, context=context))) == 3
    assert [len(ids) for ids in calls] == [len(PROMPT), 1, 1]       # the prompt's chunk, then two decode steps
    assert (stats.restored_tokens, stats.prompt_tokens) == (len(DEPTH), len(DEPTH) + len(PROMPT))


def test_a_context_needs_a_prompt_and_room_after_it(runtime):
    context = runtime.context(DEPTH)
    with pytest.raises(RequestError, match="give at least one token"):
        list(runtime.generate([], 3, GREEDY, context=context))
    with pytest.raises(RequestError, match="the prompt has 71 tokens but the context is 64"):
        list(runtime.generate(RNG.integers(0, 256, 50).tolist(), 3, GREEDY, context=context))
