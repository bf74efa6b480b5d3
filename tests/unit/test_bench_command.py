"""`moerun bench` on a tiny benchmark model: llama-bench's table, the same fields as JSON,
the forward passes each test stands for, the daemons' IPC per test with a real CPU daemon,
and clear errors for bad flags."""
from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
from math import prod
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from moerun.backends.memory import device_memory_used
from moerun.commands.bench import bench
from moerun.ipc.client import DaemonClient
from moerun.ipc.protocol import DaemonTimeout
from moerun.writers.bench_model import (
    MIXES,
    PRESETS,
    tensor_plan,
    with_layers,
    write_bench_model,
)
from tests.support.forward_calls import record_forward_calls

COLUMNS = ["model", "size", "params", "backend", "test", "t/s", "peak MiB"]
DAEMON_COLUMNS = ["calls", "MiB", "wait ms", "daemon ms"]
TINY = with_layers(PRESETS["tiny"], 1)
ONE_DAEMON = ["--daemon", "cpu", "--hot", "1"]   # 7 of the 8 experts on the daemon: every token has a remote pair
PLAN = tensor_plan(TINY, MIXES["q4_k_m"])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_bench_model(tmp_path_factory.mktemp("bench") / "tiny.gguf", TINY, MIXES["q4_k_m"])


def run_bench(*args):
    return CliRunner().invoke(bench, [str(a) for a in args], catch_exceptions=False)


def table_rows(output: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in output.splitlines()
            if line.startswith("|")]


def test_markdown_table_has_llama_bench_columns_and_a_row_per_test(model):
    result = run_bench("-m", model, "-p", "16,32", "-n", "4", "-r", "2")
    assert result.exit_code == 0, result.output
    header, rule, *rows = table_rows(result.stdout)
    assert header == COLUMNS
    assert [cell.endswith(":") for cell in rule] == [False, True, True, False, True, True, True]
    assert [row[4] for row in rows] == ["pp16", "pp32", "tg4"]
    for row in rows:
        assert row[:4] == ["tiny-qwen3moe bench Q4_K_M", row[1], row[2], "CPU"]
        assert re.fullmatch(r"\d+\.\d\d MiB", row[1]) and re.fullmatch(r"\d+\.\d\d M", row[2])
        mean, sd = re.fullmatch(r"(\d+\.\d\d) ± (\d+\.\d\d)", row[5]).groups()
        assert float(mean) > 0 and float(sd) >= 0
        assert re.fullmatch(r"\d+", row[6]) and int(row[6]) > 0


def test_json_has_the_same_fields_and_every_sample(model):
    result = run_bench("-m", model, "-p", "8", "-n", "3", "-r", "3", "-o", "json")
    assert result.exit_code == 0, result.output
    tests = json.loads(result.stdout)
    assert [t["test"] for t in tests] == ["pp8", "tg3"]
    for t, tokens in zip(tests, (8, 3)):
        assert t["model"] == "tiny-qwen3moe bench Q4_K_M" and t["backend"] == "CPU"
        assert (t["size_bytes"], t["params"]) == (sum(p.nbytes for p in PLAN), sum(prod(p.shape) for p in PLAN))
        assert len(t["samples_seconds"]) == len(t["samples_tokens_per_second"]) == 3
        assert t["samples_tokens_per_second"] == pytest.approx([tokens / s for s in t["samples_seconds"]])
        assert t["tokens_per_second"] == pytest.approx(statistics.fmean(t["samples_tokens_per_second"]))
        assert t["tokens_per_second_sd"] == pytest.approx(statistics.stdev(t["samples_tokens_per_second"]))


def test_json_has_the_peak_memory_of_the_cpu_device(model):
    """On the CPU the process's peak resident set so far, at the end of each test: it never
    shrinks from one test to the next and is at least what the process holds now (bytes, not KiB)."""
    result = run_bench("-m", model, "-p", "8", "-n", "3", "-r", "1", "-o", "json")
    assert result.exit_code == 0, result.output
    peaks = [t["peak_device_bytes"] for t in json.loads(result.stdout)]
    assert all(isinstance(peak, int) for peak in peaks) and peaks == sorted(peaks)
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert peaks[0] >= resident * 0.9       # the tests' own allocations since then may grow it a little


class FakeCupy:
    """cupy.cuda as device_memory_used calls it: the current device and memGetInfo on it."""

    def __init__(self, free_total: dict[int, tuple[int, int]]):
        self.free_total, self.current = free_total, 0
        self.cuda = SimpleNamespace(Device=self.device, runtime=SimpleNamespace(memGetInfo=self.mem_get_info))

    @contextlib.contextmanager
    def device(self, index):
        self.current, before = index, self.current
        yield
        self.current = before

    def mem_get_info(self):
        return self.free_total[self.current]


def test_a_gpu_reports_what_its_whole_device_has_in_use():
    """total - free of the backend's device, asked with that device current."""
    cupy = FakeCupy({0: (70 << 30, 80 << 30), 1: (60 << 30, 80 << 30)})
    backend = SimpleNamespace(kind="CUDA", device=SimpleNamespace(cupy=cupy, index=1))
    assert device_memory_used(backend) == 20 << 30
    assert cupy.current == 0


def test_each_test_runs_the_forward_passes_it_names_on_seeded_valid_tokens(model, monkeypatch):
    """pp8: one 8-token prefill per run; tg3: a 1-token prompt and 3 decode steps per run;
    every run once more untimed; the same token ids on every invocation."""
    calls = record_forward_calls(monkeypatch)
    assert run_bench("-m", model, "-p", "8", "-n", "3", "-r", "2").exit_code == 0
    runs = 1 + 2
    assert [len(ids) for ids in calls] == [8] * runs + [1] * (runs * (1 + 3))
    assert all(0 <= i < TINY.vocab for ids in calls for i in ids)
    first = calls[:]
    calls.clear()
    run_bench("-m", model, "-p", "8", "-n", "3", "-r", "2")
    assert [ids for ids in calls if len(ids) == 8] == [ids for ids in first if len(ids) == 8]


def test_a_size_of_0_skips_that_kind_of_test(model):
    result = run_bench("-m", model, "-p", "8", "-n", "0", "-r", "1", "-o", "json")
    assert result.exit_code == 0, result.output
    assert [t["test"] for t in json.loads(result.stdout)] == ["pp8"]
    result = run_bench("-m", model, "-p", "0", "-n", "0,3", "-r", "1")
    assert result.exit_code == 0, result.output
    assert [row[4] for row in table_rows(result.stdout)[2:]] == ["tg3"]


def test_each_depth_runs_every_test_after_that_many_tokens_of_context(model, monkeypatch):
    """-d 0,12: the tests as they are, then each after 12 tokens prefilled once per test,
    untimed; the timed runs prefill only their own tokens."""
    calls = record_forward_calls(monkeypatch)
    result = run_bench("-m", model, "-p", "8", "-n", "3", "-d", "0,12", "-r", "2", "-o", "json")
    assert result.exit_code == 0, result.output
    tests = json.loads(result.stdout)
    assert [(t["test"], t["depth"]) for t in tests] == [("pp8", 0), ("tg3", 0), ("pp8 @ d12", 12), ("tg3 @ d12", 12)]
    runs = 1 + 2
    pp, tg = [8] * runs, [1] * (runs * (1 + 3))
    assert [len(ids) for ids in calls] == pp + tg + [12] + pp + [12] + tg
    assert all(len(t["samples_seconds"]) == 2 for t in tests)


def test_a_depth_is_in_the_context_the_bench_asks_for(model):
    result = run_bench("-m", model, "-p", "8", "-n", "0", "-d", "40", "-r", "1")
    assert result.exit_code == 0, result.output
    assert [row[4] for row in table_rows(result.stdout)[2:]] == ["pp8 @ d40"]


def test_without_daemons_there_is_no_daemon_field(model):
    result = run_bench("-m", model, "-p", "8", "-n", "2", "-r", "1", "-o", "json")
    assert result.exit_code == 0, result.output
    assert all("daemons" not in t and "rig" not in t for t in json.loads(result.stdout))


@pytest.fixture(scope="module")
def daemon_runs(model):
    """mode -> the JSON tests of pp8 and tg4 with one CPU daemon."""
    runs = {}
    for mode in ("stream", "batched"):
        result = run_bench("-m", model, *ONE_DAEMON, "--mode", mode, "-p", "8", "-n", "4", "-r", "1", "-o", "json")
        assert result.exit_code == 0, result.output
        runs[mode] = {t["test"]: t for t in json.loads(result.stdout)}
    return runs


@pytest.mark.parametrize("mode", ["stream", "batched"])
def test_json_has_the_daemons_work_per_test_and_the_rig_settings(daemon_runs, mode):
    tests = daemon_runs[mode]
    assert list(tests) == ["pp8", "tg4"]
    for t in tests.values():
        daemons = t["daemons"]
        assert set(daemons) == {"calls", "mib", "wait_ms", "daemon_ms", "remote_pair_share", "cache_hit_rate",
                                "streamed_pair_share", "read_pair_share"}
        assert daemons["calls"] > 0 and daemons["wait_ms"] > 0 and daemons["daemon_ms"] > 0
        assert 0.5 <= daemons["remote_pair_share"] <= 1.0
        assert t["rig"] == {"transport": ["shared"], "mode": mode, "payload_dtype": "f32", "hot": 1,
                            "stream_threshold": "auto", "expert_cache_bytes": 0, "gpu_reads": "off"}
        assert daemons["cache_hit_rate"] == daemons["streamed_pair_share"] == daemons["read_pair_share"] == 0.0
    # at least every token's f32 row out and its f32 reply back
    assert tests["pp8"]["daemons"]["mib"] >= 8 * TINY.hidden * 4 * 2 / 2**20
    assert tests["tg4"]["daemons"]["calls"] == 1 + 4     # the 1-token prompt, then one call per decode step


def test_stream_mode_prefills_in_more_calls_than_batched(daemon_runs):
    """8 prompt tokens: two 4-token slices in stream mode, one call in batched mode."""
    stream, batched = (daemon_runs[mode]["pp8"]["daemons"]["calls"] for mode in ("stream", "batched"))
    assert (stream, batched) == (2, 1)
    assert daemon_runs["stream"]["tg4"]["daemons"]["calls"] == daemon_runs["batched"]["tg4"]["daemons"]["calls"]


def test_markdown_table_adds_daemon_columns_and_a_silent_daemon_shows_a_dash(model, monkeypatch):
    asked = []

    def no_stats(self, timeout_s=10.0):
        asked.append(timeout_s)
        raise DaemonTimeout("no STATS reply")

    monkeypatch.setattr(DaemonClient, "stats", no_stats)
    result = run_bench("-m", model, *ONE_DAEMON, "-p", "8", "-n", "2", "-r", "2")
    assert result.exit_code == 0, result.output
    assert len(asked) == 1, "a daemon silent once is not asked again: one timeout, not one per test"
    header, _, *rows = table_rows(result.stdout)
    assert header == COLUMNS + DAEMON_COLUMNS
    assert [row[4] for row in rows] == ["pp8", "tg2"]
    for row in rows:
        calls, mib, wait_ms, daemon_ms = row[7:]
        # the wait is rounded to 0.1 ms in the table (the JSON test above checks it is counted)
        assert float(calls) > 0 and float(mib) > 0 and float(wait_ms) >= 0 and daemon_ms == "-"


@pytest.mark.parametrize("flags, message", [
    (["-p", "-1"], "token counts cannot be negative"),
    (["-p", "0", "-n", "0"], "Nothing to measure: -p and -n are both 0"),
    (["-n", "16,x"], "expected token counts separated by commas"),
    (["-o", "xml"], "'xml' is not one of 'md', 'json'"),
    (["-r", "0"], "0 is not in the range x>=1"),
    (["-p", "16", "-n", "64", "--ctx", "32"], "32 is too small for tg64, which needs 65 positions"),
    (["-p", "16", "-n", "0", "-d", "20", "--ctx", "32"], "32 is too small for pp16 @ d20, which needs 36 positions"),
    (["-d", "-4"], "depths cannot be negative"),
    (["-d", "0,deep"], "expected depths separated by commas, like 0,16384"),
])
def test_bad_flags_are_refused_clearly(model, flags, message):
    result = run_bench("-m", model, *flags)
    assert result.exit_code == 2
    assert message in result.output


def test_the_model_may_come_from_a_config_file(model, tmp_path):
    config = tmp_path / "rig.toml"
    config.write_text(f"model = {str(model)!r}\nctx = 64\n")
    result = run_bench("--config", config, "-p", "8", "-n", "2", "-r", "1")
    assert result.exit_code == 0, result.output
    assert [row[4] for row in table_rows(result.stdout)[2:]] == ["pp8", "tg2"]


def test_without_a_model_it_measures_the_demo_model():
    result = run_bench("-p", "8", "-n", "0", "-r", "1")
    assert result.exit_code == 0, result.output
    assert "built-in demo model" in result.stderr and "pp8" in result.stdout


def test_a_missing_model_is_one_error_line(tmp_path):
    result = run_bench("-m", tmp_path / "absent.gguf", "-p", "4", "-n", "2", "-r", "1")
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and "absent.gguf" in result.output

