"""A CPU daemon reads its experts' pages ahead in the background after ASSIGN (MADV_WILLNEED):
the byte ranges asked for, the pages that come into the page cache, and a READY that does not
wait for them. Residency is read with mincore() after the file's pages are dropped from the
page cache (fsync, then POSIX_FADV_DONTNEED)."""
from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from moerun.backends.cpu.library import load_kernels
from moerun.daemons.handler import ExpertDaemon
from moerun.gguf.reader import GGUFFile
from moerun.ipc.client import DaemonClient
from moerun.writers.synthetic import SyntheticConfig, write_synthetic_model
from tests.support.daemon_fixtures import wait_for_socket

# F32 experts of 256 KiB per matrix: many pages each
CONFIG = SyntheticConfig(name="willneed-test", n_layers=2, hidden=256, n_heads=2, n_kv_heads=1, head_dim=128,
                         n_experts=8, n_experts_used=2, expert_ff=256, vocab_size=300, ftype="F32")
ASSIGNED = {0: [1, 2], 1: [5]}
UNASSIGNED = {0: [4, 5], 1: [2]}      # away from the pages around a tensor's start, which a daemon maps
PAGE = mmap.PAGESIZE


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("willneed") / "m.gguf", CONFIG,
                                 "pages read ahead of use. " * 40, bigram_head=False)


def drop_from_page_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident(path, ranges: list[tuple[int, int]]) -> list[float]:
    """The share of each (start, length) range's pages in the page cache."""
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        data = np.frombuffer(mapping, np.uint8)
        pages = np.zeros(-(-len(mapping) // PAGE), np.uint8)
        assert mincore(data.ctypes.data, len(mapping), pages.ctypes.data) == 0
        del data
    return [float((pages[start // PAGE:-(-(start + length) // PAGE)] & 1).mean()) for start, length in ranges]


def expert_ranges(gguf: GGUFFile, experts: dict[int, list[int]]) -> list[tuple[int, int]]:
    return [span for layer, ids in experts.items() for part in ("gate", "up", "down")
            for span in gguf.expert_ranges(f"blk.{layer}.ffn_{part}_exps.weight", ids)]


def dropped_or_skip(model, wanted, others) -> list[float]:
    """Drop the file's pages from the page cache; the residency of `others` then."""
    drop_from_page_cache(model)
    others_before = resident(model, others)
    if any(resident(model, wanted)) or max(others_before) > 0.5:
        pytest.skip("this machine keeps the file's pages in the page cache")
    return others_before


def none_read_in(model, others, before) -> bool:
    return all(now <= then for now, then in zip(resident(model, others), before))


def wait_resident(model, ranges, timeout_s: float = 20.0) -> list[float]:
    deadline = time.monotonic() + timeout_s
    while (shares := resident(model, ranges)) != [1.0] * len(ranges) and time.monotonic() < deadline:
        time.sleep(0.05)
    return shares


def test_expert_ranges_are_one_per_run_of_consecutive_experts(model):
    with GGUFFile(model) as gguf:
        info = gguf.tensor("blk.0.ffn_up_exps.weight")
        stride = info.nbytes // 8
        assert stride == 256 * 256 * 4
        assert gguf.expert_ranges(info.name, [5, 1, 2, 2]) == [(info.offset + stride, 2 * stride),
                                                               (info.offset + 5 * stride, stride)]


def test_will_need_brings_those_pages_and_no_others_into_the_page_cache(model):
    with GGUFFile(model) as gguf:
        wanted, others = expert_ranges(gguf, ASSIGNED), expert_ranges(gguf, UNASSIGNED)
        before = dropped_or_skip(model, wanted, others)
        gguf.will_need(wanted)
        assert wait_resident(model, wanted) == [1.0] * len(wanted)
        assert none_read_in(model, others, before)


def test_will_need_on_a_closed_file_does_nothing(model):
    gguf = GGUFFile(model)
    ranges = expert_ranges(gguf, ASSIGNED)
    gguf.close()
    gguf.will_need(ranges)


def test_assign_starts_the_prefetch_thread_and_returns_without_waiting_for_it(model, monkeypatch):
    load_kernels()                      # built (or loaded) before ASSIGN is timed
    daemon = ExpertDaemon(str(model), "cpu")
    asked, release = [], threading.Event()

    def slow_will_need(ranges):
        asked.extend(ranges)
        release.wait(30)

    monkeypatch.setattr(daemon.gguf, "will_need", slow_will_need)
    try:
        started = time.monotonic()
        daemon.assign(ASSIGNED, lambda done, total: None)
        assert time.monotonic() - started < 10
        assert daemon.prefetch is not None and daemon.prefetch.is_alive()
        assert daemon.prefetch.daemon            # never keeps the process from exiting
        assert asked == expert_ranges(daemon.gguf, ASSIGNED)
        x = np.ones((1, CONFIG.hidden), np.float32)
        out = daemon.compute(0, x, np.array([2]), np.array([0, 1]), np.array([0.5, 0.5], np.float32))
        assert out.shape == (1, CONFIG.hidden)      # requests are served while the pages come in
    finally:
        release.set()
        daemon.prefetch.join(10)
        daemon.gguf.close()
    assert not daemon.prefetch.is_alive()


def test_a_real_daemon_reads_its_experts_ahead_after_ready(model, tmp_path):
    with GGUFFile(model) as gguf:
        fingerprint = gguf.fingerprint()
        wanted, others = expert_ranges(gguf, ASSIGNED), expert_ranges(gguf, UNASSIGNED)
    endpoint = f"ipc://{tmp_path}/d.sock"
    with (tmp_path / "d.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "moerun", "daemon", "-m", str(model), "--listen", endpoint,
                                    "--threads", "1"], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        wait_for_socket(tmp_path / "d.sock", process)
        before = dropped_or_skip(model, wanted, others)
        with DaemonClient(endpoint, connect_timeout_s=60) as client:
            client.hello(fingerprint)
            client.assign(ASSIGNED)
            assert wait_resident(model, wanted) == [1.0] * len(wanted)     # no request has touched them
            assert none_read_in(model, others, before)
            client.shutdown()
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
