"""Experts computed by daemons give the all-local result: every architecture, 1–3
daemons, both transports, both modes, every payload dtype, several --hot values."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from moerun.engine.report import stats_document
from moerun.engine.runtime import RunStats, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.rig.settings import RigConfig
from tests.support.daemon_fixtures import running_daemons
from tests.support.hf_models import ARCHS, HYBRID_ARCHS, tiny_model
from tests.support.shm_segments import shm_segments
from tests.support.to_gguf import write_gguf

PROMPT = np.random.default_rng(7).integers(0, 320, 21).tolist()
BOUNDS = {"f32": 1e-5, "f16": 2e-3, "bf16": 2e-2}    # max |daemons - local| / max |local|
UBATCH = 8                                           # several prefill chunks, and 2 stream slices per chunk


@pytest.fixture(scope="module", params=ARCHS + HYBRID_ARCHS)
def rig_model(request, tmp_path_factory):
    """(model path, local logits, local greedy tokens, three daemon endpoints)."""
    folder = tmp_path_factory.mktemp(request.param)
    path = write_gguf(tiny_model(request.param, seed=3), folder / "model.gguf", "Q8_0")
    with Runtime(path, ubatch=UBATCH) as local:
        logits = local.logits(PROMPT)
        tokens = list(local.generate(PROMPT[:6], 10, SamplingParams(temperature=0.0)))
    with running_daemons(path, 3, folder) as endpoints:
        yield path, logits, tokens, endpoints


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))


CASES = list(itertools.product([1, 2, 3], ["shared", "stream"], ["batched", "stream"], ["f32", "f16", "bf16"], [0, 3]))


@pytest.mark.parametrize("n_daemons, transport, mode, dtype, hot", CASES,
                         ids=[f"{n}d-{t}-{m}-{d}-hot{h}" for n, t, m, d, h in CASES])
def test_logits_equal_all_local(rig_model, n_daemons, transport, mode, dtype, hot):
    path, expected, _, endpoints = rig_model
    rig = RigConfig(daemons=tuple(endpoints[:n_daemons]), hot=hot, transport=transport, mode=mode,
                    payload_dtype=dtype, daemon_timeout_s=20)
    with Runtime(path, ubatch=UBATCH, rig=rig) as runtime:
        stats = RunStats()
        got = runtime.logits(PROMPT, stats)
        document = stats_document(runtime, stats)
    error = relative_error(got, expected)
    assert error <= BOUNDS[dtype], f"{error:.2e}"
    if dtype != "f32":
        assert error > 0, "the payload dtype was not applied"
    assert document["remote_pairs"] > 0 and document["fallback_pairs"] == 0
    assert all(d["transport"] == transport and d["calls"] > 0 for d in document["daemons"])
    assert not shm_segments()


@pytest.mark.parametrize("n_daemons, transport, mode", list(itertools.product([1, 3], ["shared", "stream"],
                                                                               ["batched", "stream"])))
def test_greedy_tokens_equal_all_local(rig_model, n_daemons, transport, mode):
    path, _, expected, endpoints = rig_model
    rig = RigConfig(daemons=tuple(endpoints[:n_daemons]), hot=1, transport=transport, mode=mode)
    with Runtime(path, ubatch=UBATCH, rig=rig) as runtime:
        assert list(runtime.generate(PROMPT[:6], 10, SamplingParams(temperature=0.0))) == expected


def test_hot_only_layers_skip_ipc(rig_model):
    """With every expert hot, daemons are connected but never asked to compute."""
    path, expected, _, endpoints = rig_model
    with Runtime(path, ubatch=UBATCH, rig=RigConfig(daemons=(endpoints[0],), hot=8)) as runtime:
        stats = RunStats()
        np.testing.assert_array_equal(runtime.logits(PROMPT, stats), expected)
        document = stats_document(runtime, stats)
    assert document["hot_only_layer_share"] == 1.0 and document["daemons"][0]["calls"] == 0
