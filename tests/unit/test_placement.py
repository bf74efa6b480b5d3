"""moerun.moe.placement on its own: the --hot dealing rule, the global -> local expert ids
each home uses, the placement file written and read back, and the messages for files that do
not fit the model or the --daemon list.

Shape legend: L layers, E experts, D daemons.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from moerun.moe.placement import (
    PARENT,
    Placement,
    PlacementError,
    hot_placement,
    load_placement,
)
from tests.support.gpu import small_spec

FINGERPRINT = "ab" * 32
MOE = (False, True, True, False, True)       # a dense first layer and a dense middle layer
MOE_LAYERS = [i for i, is_moe in enumerate(MOE) if is_moe]


def spec_with(experts: int, moe=MOE):
    return dataclasses.replace(small_spec(experts=experts, top_k=2), n_layers=len(moe), moe_layers=moe)


def random_placement(rng, experts: int, daemons: int, layers=MOE_LAYERS) -> Placement:
    homes = {layer: rng.integers(PARENT, daemons, experts).astype(np.int16) for layer in layers}
    return Placement(homes, tuple(f"d{i}" for i in range(daemons)))


# -- --hot N

@pytest.mark.parametrize("experts, hot, daemons", [
    (8, 2, 2), (8, 3, 2), (8, 2, 3), (16, 8, 1), (8, 0, 3), (8, 8, 2), (8, 12, 2), (60, 4, 3), (8, 2, 0),
])
def test_hot_placement_deals_the_cold_experts_round_robin(experts, hot, daemons):
    specs = [f"cpu{i}" for i in range(daemons)]
    placement = hot_placement(spec_with(experts), hot, specs)
    assert placement.daemon_specs == tuple(specs)
    assert sorted(placement.homes) == MOE_LAYERS                # dense layers get no entry
    # Expected: experts 0..hot-1 on the parent; cold expert hot+i on daemon i mod D.
    want = [PARENT if e < hot or daemons == 0 else (e - hot) % daemons for e in range(experts)]
    for layer in MOE_LAYERS:
        assert placement.homes[layer].tolist() == want
    if daemons:
        shares = [want.count(d) for d in range(daemons)]
        assert sum(shares) == max(experts - hot, 0)
        assert max(shares) - min(shares) <= 1                 # an even deal


def test_hot_placement_with_no_daemon_keeps_every_expert_on_the_parent():
    placement = hot_placement(spec_with(8), 2, [])
    assert placement.n_daemons == 0
    assert all(np.all(homes == PARENT) for homes in placement.homes.values())


# -- experts_of and local_ids

@pytest.mark.parametrize("seed", range(8))
def test_experts_of_and_local_ids_agree_with_their_definition(seed):
    rng = np.random.default_rng(seed)
    experts, daemons = int(rng.integers(1, 20)), int(rng.integers(1, 4))
    placement = random_placement(rng, experts, daemons)
    for home in (PARENT, *range(daemons)):
        held = placement.experts_of(home)
        for layer in MOE_LAYERS:
            row = placement.homes[layer].tolist()
            mine = [e for e in range(experts) if row[e] == home]       # ascending global ids
            if mine:
                assert held[layer] == mine
            else:
                assert layer not in held
            local = placement.local_ids(layer, home)                    # [E]
            assert local.shape == (experts,)
            assert local.tolist() == [mine.index(e) if row[e] == home else -1 for e in range(experts)]
            # local -> global through experts_of is the identity on the home's experts
            for e in mine:
                assert held[layer][local[e]] == e


@pytest.mark.parametrize("seed", range(4))
def test_every_expert_has_exactly_one_local_id(seed):
    rng = np.random.default_rng(100 + seed)
    placement = random_placement(rng, 16, 3)
    for layer in MOE_LAYERS:
        locals_ = np.stack([placement.local_ids(layer, home) for home in (PARENT, 0, 1, 2)])  # [D+1, E]
        assert np.all((locals_ >= 0).sum(axis=0) == 1)
        for row in locals_:                                             # 0..n-1, each once
            assert sorted(row[row >= 0].tolist()) == list(range(int((row >= 0).sum())))


def test_to_json_reads_back(tmp_path):
    placement = random_placement(np.random.default_rng(5), 8, 2)
    file = tmp_path / "p.json"
    file.write_text(placement.to_json(FINGERPRINT))
    document = json.loads(file.read_text())
    assert document["format"] == "moerun-placement/1" and document["fingerprint"] == FINGERPRINT
    back = load_placement(file, spec_with(8), ["tcp://a:1", "tcp://b:2"], FINGERPRINT)
    assert back.daemon_specs == ("tcp://a:1", "tcp://b:2")        # the --daemon list wins
    assert sorted(back.homes) == MOE_LAYERS
    for layer in MOE_LAYERS:
        np.testing.assert_array_equal(back.homes[layer], placement.homes[layer])


def test_a_file_without_fingerprint_fits_any_model(tmp_path):
    file = tmp_path / "p.json"
    file.write_text(random_placement(np.random.default_rng(6), 8, 1).to_json(None))
    assert load_placement(file, spec_with(8), ["cpu"], FINGERPRINT).n_daemons == 1


# -- files that do not fit

def document(**change) -> dict:
    base = {"format": "moerun-placement/1", "fingerprint": FINGERPRINT, "daemons": ["cpu", "cuda:1"],
            "layers": {str(layer): [-1, -1, 0, 1, 0, 1, 0, 1] for layer in MOE_LAYERS}}
    return {**base, **change}


def layers_with(row) -> dict:
    return {str(layer): row for layer in MOE_LAYERS}


@pytest.mark.parametrize("content, problem", [
    ("{not json", "cannot read placement"),
    (b"\xff\xfe\x00", "cannot read placement"),
    (json.dumps([1, 2]), "not a placement file"),
    (json.dumps(document(format="moerun-placement/2")), "not a placement file"),
    (json.dumps(document(fingerprint="cd" * 32)), "different model file"),
    (json.dumps(document(daemons=["cpu"])), "was made for 1 daemon (cpu) but the rig has 2 daemons (cpu, cuda:1)"),
    (json.dumps(document(daemons="cpu")), "\"daemons\" must list the daemons"),
    (json.dumps(document(layers=[1])), "\"layers\" must map layer numbers"),
    (json.dumps(document(layers={**layers_with([-1] * 8), "0": [-1] * 8})), "layer '0' is not a MoE layer"),
    (json.dumps(document(layers={**layers_with([-1] * 8), "9": [-1] * 8})), "layer '9' is not a MoE layer"),
    (json.dumps(document(layers={**layers_with([-1] * 8), "x": [-1] * 8})), "layer 'x' is not a MoE layer"),
    (json.dumps(document(layers=layers_with([-1, -1, 0, 1, 0, 1, 0, 2]))), "daemon index 0..1"),
    (json.dumps(document(layers=layers_with([-2, -1, 0, 1, 0, 1, 0, 1]))), "each -1 (parent)"),
    (json.dumps(document(layers=layers_with([-1] * 7))), "expected 8 homes"),
    (json.dumps(document(layers=layers_with([-1] * 9))), "expected 8 homes"),
    (json.dumps(document(layers=layers_with([-1, 0.0, 0, 1, 0, 1, 0, 1]))), "expected 8 homes"),
    (json.dumps(document(layers=layers_with("-1" * 8))), "expected 8 homes"),
    (json.dumps(document(layers={"1": [-1] * 8})), "no homes for MoE layers [2, 4]"),
])
def test_bad_files_are_refused_naming_the_problem(tmp_path, content, problem):
    file = tmp_path / "bad.json"
    (file.write_bytes if isinstance(content, bytes) else file.write_text)(content)
    with pytest.raises(PlacementError) as caught:
        load_placement(file, spec_with(8), ["cpu", "cuda:1"], FINGERPRINT)
    assert str(caught.value).startswith(f"{file}: ")
    assert problem in str(caught.value)


def test_a_missing_file_is_refused_naming_it(tmp_path):
    file = tmp_path / "absent.json"
    with pytest.raises(PlacementError, match="absent.json: cannot read placement"):
        load_placement(file, spec_with(8), ["cpu"], FINGERPRINT)


def test_the_layer_message_names_the_layer(tmp_path):
    file = tmp_path / "p.json"
    file.write_text(json.dumps(document(layers={"1": [-1] * 8, "2": [-1] * 8, "4": [5] * 8})))
    with pytest.raises(PlacementError, match="layer 4: expected 8 homes"):
        load_placement(file, spec_with(8), ["cpu", "cuda:1"], FINGERPRINT)


def test_booleans_are_not_daemon_indices(tmp_path):
    file = tmp_path / "p.json"
    file.write_text(json.dumps(document(layers=layers_with([-1, -1, True, False, 0, 1, 0, 1]))))
    with pytest.raises(PlacementError, match="expected 8 homes"):
        load_placement(file, spec_with(8), ["cpu", "cuda:1"], FINGERPRINT)


@pytest.mark.parametrize("key", ["²", "٣", "01", "+1", " 1"])
def test_a_layer_key_that_is_not_a_plain_decimal_is_refused_naming_the_file(tmp_path, key):
    """Keys that int() would take (or that would shadow layer 1) are no layer numbers."""
    file = tmp_path / "p.json"
    file.write_text(json.dumps(document(layers={**layers_with([-1] * 8), key: [-1] * 8})))
    with pytest.raises(PlacementError, match=f"{file}.*not a MoE layer"):
        load_placement(file, spec_with(8), ["cpu", "cuda:1"], FINGERPRINT)
