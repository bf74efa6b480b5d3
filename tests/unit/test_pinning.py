"""Pinning with real processes: a spawned daemon held to its CPUs before it starts (every one of
its threads), a rig whose parent and daemon each get their own CPUs with --pin, and
`moerun daemon --numa-node`. The daemons talk over `stream` (no shared memory segments)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moerun.engine.runtime import Runtime
from moerun.rig.cores import node_cpus
from moerun.rig.settings import DaemonEntry, RigConfig
from moerun.rig.spawn import spawn_daemon
from moerun.writers.synthetic import SyntheticConfig, write_synthetic_model
from tests.support.daemon_fixtures import wait_for_socket

TINY = SyntheticConfig(name="pin-test", n_layers=2, hidden=64, n_heads=2, n_kv_heads=1, head_dim=32,
                       n_experts=4, n_experts_used=2, expert_ff=32, vocab_size=300)
HOST = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(len(HOST) < 2, reason="needs two CPUs this process may use")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("pin") / "tiny.gguf", TINY, "each to its own core. " * 40,
                                 bigram_head=False)


def thread_affinities(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of process `pid`."""
    return {frozenset(os.sched_getaffinity(int(task))) for task in os.listdir(f"/proc/{pid}/task")}


def arguments(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@needs_two_cpus
def test_a_pinned_spawned_daemon_runs_every_thread_on_its_cpus(model, tmp_path):
    cpus = (HOST[-1],)
    daemon = spawn_daemon("cpu", model, f"ipc://{tmp_path}/d.sock", tmp_path / "d.log", threads=1, cpus=cpus)
    try:
        wait_for_socket(tmp_path / "d.sock", daemon.process)
        assert os.sched_getaffinity(daemon.process.pid) == set(cpus)
        assert thread_affinities(daemon.process.pid) == {frozenset(cpus)}
    finally:
        daemon.stop()


@needs_two_cpus
def test_a_pinned_rig_holds_the_parent_and_its_daemon_to_their_own_cpus(model):
    ids = list(range(1, 12))
    with Runtime(model) as local:
        want = local.logits(ids)
    rig = RigConfig(daemons=("cpu",), hot=0, transport="stream", require_daemons=True, daemon_timeout_s=30, pin=True)
    with Runtime(model, rig=rig) as runtime:
        parent, daemon = runtime.cpus.parent, runtime.cpus.daemons[0]
        assert set(parent.cpus).isdisjoint(daemon.cpus) and set(parent.cpus) | set(daemon.cpus) == set(HOST)
        pid = runtime.rig.links[0].local.process.pid
        assert thread_affinities(os.getpid()) == {frozenset(parent.cpus)}
        assert thread_affinities(pid) == {frozenset(daemon.cpus)}
        command = arguments(pid)
        assert command[command.index("--threads") + 1] == str(daemon.threads)
        got = runtime.logits(ids)
        assert runtime.moe_stats().remote_pairs > 0
    assert os.sched_getaffinity(0) == set(HOST)               # released with the runtime
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_daemon_entry_gives_its_thread_count_and_numa_node_to_the_spawned_daemon(model):
    entry = DaemonEntry("solo", device="cpu", threads=2, numa_node=0)
    rig = RigConfig(daemons=("cpu",), daemon_entries=(entry,), hot=0, transport="stream", threads=1)
    with Runtime(model, rig=rig) as runtime:
        pid = runtime.rig.links[0].local.process.pid
        command = arguments(pid)
        assert command[command.index("--threads") + 1] == "2"
        assert command[command.index("--numa-node") + 1] == "0"
        assert os.sched_getaffinity(pid) == node_cpus(0) & set(HOST)
        assert runtime.backend.threads == 1


def run_daemon(model, tmp_path, *flags) -> subprocess.Popen:
    log = (tmp_path / "d.log").open("wb")
    return subprocess.Popen([sys.executable, "-m", "moerun", "daemon", "-m", str(model), "--listen",
                             f"ipc://{tmp_path}/d.sock", *flags], stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def test_numa_node_holds_a_daemon_to_that_nodes_cpus(model, tmp_path):
    process = run_daemon(model, tmp_path, "--numa-node", "0")
    try:
        wait_for_socket(tmp_path / "d.sock", process)
        assert thread_affinities(process.pid) == {node_cpus(0) & set(HOST)}
    finally:
        process.terminate()
        process.wait(30)
    assert "on NUMA node 0: CPUs" in (tmp_path / "d.log").read_text()


def test_a_numa_node_this_machine_lacks_is_an_error_naming_its_path(model, tmp_path):
    process = run_daemon(model, tmp_path, "--numa-node", "4096")
    assert process.wait(60) == 1
    assert ("Error: NUMA node 4096: /sys/devices/system/node/node4096/cpulist does not exist (no such node on "
            "this machine, or not Linux)") in (tmp_path / "d.log").read_text()
