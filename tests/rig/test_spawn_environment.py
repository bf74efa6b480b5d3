"""A spawned daemon runs the installed moerun even when the parent's working directory
holds a source tree (or anything else) named moerun."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig
from moerun.writers.synthetic import SyntheticConfig, write_synthetic_model

TINY = SyntheticConfig(name="spawn-test", n_layers=2, hidden=64, n_heads=2, n_kv_heads=1, head_dim=32,
                       n_experts=4, n_experts_used=2, expert_ff=32, vocab_size=300)


def test_daemon_ignores_a_moerun_in_the_working_directory(tmp_path, monkeypatch):
    model = write_synthetic_model(tmp_path / "tiny.gguf", TINY, "the parent spawns a daemon. " * 40,
                                  bigram_head=False)
    decoy = tmp_path / "cwd" / "moerun"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy moerun was imported')\n")
    (decoy / "__main__.py").write_text("raise SystemExit('the decoy moerun ran')\n")
    monkeypatch.chdir(decoy.parent)
    ids = list(range(1, 12))
    with Runtime(model) as local:
        want = local.logits(ids)
    rig = RigConfig(daemons=("cpu",), hot=0, require_daemons=True, daemon_timeout_s=20)
    with Runtime(model, rig=rig) as remote:
        got = remote.logits(ids)
        assert remote.moe_stats().remote_pairs > 0
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_spawned_daemon_sees_only_its_own_gpu():
    from moerun.rig.spawn import pinned_device
    assert pinned_device("cuda:1", {}) == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "1"})
    assert pinned_device("hip:2", {}) == ("hip:0", {"HIP_VISIBLE_DEVICES": "2", "ROCR_VISIBLE_DEVICES": "2"})
    assert pinned_device("cpu", {"CUDA_VISIBLE_DEVICES": "3"}) == ("cpu", {})


def test_cuda_n_counts_among_the_gpus_the_parent_sees():
    """A parent started with CUDA_VISIBLE_DEVICES=2,3 calls the second of those cuda:1."""
    from moerun.rig.spawn import pinned_device
    assert pinned_device("cuda:1", {"CUDA_VISIBLE_DEVICES": "2,3"}) == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "3"})
    with pytest.raises(ValueError, match="leaves only 1 GPU"):
        pinned_device("cuda:1", {"CUDA_VISIBLE_DEVICES": "2"})
