"""The architecture registry (moerun/models/registry.py): one module per architecture, named
after its family, each declaring its rule, what it reads of the metadata and its layer, and
each with a tiny Hugging Face model that the oracle tests compare it with."""
from __future__ import annotations

import pytest

from moerun.gguf.reader import GGUFFile
from moerun.models import load_spec
from moerun.models.registry import ARCHITECTURES
from tests.support.hf_models import ARCHS, HYBRID_ARCHS, tiny_model
from tests.support.to_gguf import write_gguf


@pytest.mark.parametrize("gguf_arch", sorted(ARCHITECTURES))
def test_a_module_per_architecture(gguf_arch):
    module = ARCHITECTURES[gguf_arch]
    assert module.__name__ == f"moerun.models.{module.RULE.family}"
    assert callable(module.read_spec) and callable(module.layer)


def test_every_architecture_has_an_oracle_model():
    assert {module.RULE.family for module in ARCHITECTURES.values()} == set(ARCHS + HYBRID_ARCHS)


@pytest.mark.parametrize("family", ARCHS + HYBRID_ARCHS)
def test_load_spec_takes_the_architecture_module_rule(family, tmp_path):
    path = write_gguf(tiny_model(family), tmp_path / f"{family}.gguf", "F32")
    with GGUFFile(path) as gguf:
        spec = load_spec(gguf)
    assert spec.rule is ARCHITECTURES[spec.rule.gguf_arch].RULE and spec.family == family
