"""Shared fixtures: a moerun CLI runner and isolation of the user's cache directory; every zmq
context a test makes is closed by its end (tests/support/zmq_contexts.py)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from tests.support.shm_segments import shm_segments

pytest_plugins = ["tests.support.zmq_contexts"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Never touch the real ~/.cache/moerun from tests."""
    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path_factory.getbasetemp() / "moerun-cache"))


@pytest.fixture(autouse=True)
def _no_leftover_shared_memory():
    """Whatever a test does, it leaves no moerun segment of its own in /dev/shm."""
    yield
    assert shm_segments() == set()


@pytest.fixture
def moerun():
    """Call the CLI in-process: moerun("logits", "-m", path, ...) -> click Result."""
    from moerun.cli import main

    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)
    return invoke


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu run only where CuPy sees a GPU (scripts/gpu_tests.sh runs them there)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    from tests.support.gpu import gpu_device
    if gpu_device() is None:
        skip = pytest.mark.skip(reason="no CUDA or ROCm GPU on this machine")
        for item in gpu_items:
            item.add_marker(skip)
