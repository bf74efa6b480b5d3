"""Fixtures of the live server tests."""
from __future__ import annotations

import pytest

from moerun.writers.demo import demo_model_path


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """The built-in demo model, written once for the session in a cache of its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOERUN_CACHE", str(tmp_path_factory.mktemp("cache")))
        return demo_model_path()
