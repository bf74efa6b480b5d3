"""Placement files and the IPC saving of batched prefill, with real daemons."""
from __future__ import annotations

import json

import numpy as np
import pytest

from moerun.engine.report import stats_document
from moerun.engine.runtime import RunStats, Runtime
from moerun.gguf.reader import GGUFFile
from moerun.moe.placement import PlacementError
from moerun.rig.settings import RigConfig
from tests.support.daemon_fixtures import running_daemons
from tests.support.hf_models import tiny_model
from tests.support.to_gguf import write_gguf

LAYERS, EXPERTS = 3, 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("placement")
    path = write_gguf(tiny_model("qwen2moe", seed=6), folder / "m.gguf", "Q8_0")
    with running_daemons(path, 2, folder) as endpoints:
        yield path, endpoints


def placement_file(path, layers, daemons=("cpu", "cpu"), fingerprint=None):
    path.write_text(json.dumps({"format": "moerun-placement/1", "fingerprint": fingerprint,
                                "daemons": list(daemons), "layers": layers}))
    return path


def test_placement_file_gives_all_local_logits(model, tmp_path):
    path, endpoints = model
    rng = np.random.default_rng(0)
    layers = {str(i): rng.integers(-1, 2, EXPERTS).tolist() for i in range(LAYERS)}
    with GGUFFile(path) as gguf:
        fingerprint = gguf.fingerprint()
    file = placement_file(tmp_path / "p.json", layers, fingerprint=fingerprint)
    ids = rng.integers(0, 320, 30).tolist()
    with Runtime(path) as local:
        expected = local.logits(ids)
    with Runtime(path, rig=RigConfig(daemons=tuple(endpoints), placement=str(file))) as runtime:
        assigned = {link.index: runtime.rig.placement.experts_of(link.index) for link in runtime.rig.links}
        got = runtime.logits(ids)
    assert np.max(np.abs(got - expected)) <= 1e-5 * np.max(np.abs(expected))
    for daemon in (0, 1):
        assert assigned[daemon] == {i: [e for e, h in enumerate(layers[str(i)]) if h == daemon]
                                    for i in range(LAYERS) if daemon in layers[str(i)]}


@pytest.mark.parametrize("document, phrase", [
    ({"layers": {}}, "not a placement file"),
    ({"format": "moerun-placement/1", "daemons": ["cpu"], "layers": {}},
     "made for 1 daemon (cpu) but the rig has 2 daemons"),
    ({"format": "moerun-placement/1", "daemons": ["cpu", "cpu"], "layers": {"0": [0] * EXPERTS}},
     "no homes for MoE layers [1, 2]"),
    ({"format": "moerun-placement/1", "daemons": ["cpu", "cpu"],
      "layers": {str(i): [2] * EXPERTS for i in range(LAYERS)}}, "daemon index"),
    ({"format": "moerun-placement/1", "daemons": ["cpu", "cpu"],
      "layers": {str(i): [0] * (EXPERTS - 1) for i in range(LAYERS)}}, f"expected {EXPERTS} homes"),
    ({"format": "moerun-placement/1", "daemons": ["cpu", "cpu"], "fingerprint": "0" * 64,
      "layers": {str(i): [0] * EXPERTS for i in range(LAYERS)}}, "different model file"),
])
def test_bad_placement_files(model, tmp_path, document, phrase):
    path, endpoints = model
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(document))
    with pytest.raises(PlacementError, match="bad.json") as caught:
        Runtime(path, rig=RigConfig(daemons=tuple(endpoints), placement=str(file)))
    assert phrase in str(caught.value)


def test_batched_prefill_makes_a_tenth_of_the_calls_of_stream_mode(model):
    """A 512-token prefill: one call per daemon per layer per chunk against one per 4 tokens."""
    path, endpoints = model
    ids = np.random.default_rng(1).integers(0, 320, 512).tolist()
    calls = {}
    for mode in ("batched", "stream"):
        rig = RigConfig(daemons=tuple(endpoints), hot=2, mode=mode)
        with Runtime(path, ctx=512, ubatch=512, rig=rig) as runtime:
            stats = RunStats()
            runtime.logits(ids, stats)
            calls[mode] = sum(d["calls"] for d in stats_document(runtime, stats)["daemons"])
    assert calls["batched"] == 2 * LAYERS
    assert calls["batched"] <= 0.1 * calls["stream"]
