"""`moerun bench` on a tiny benchmark model: llama-bench's table, the same fields as JSON,
the forward passes each test stands for, and clear errors for bad flags."""
from __future__ import annotations

import json
import re
import statistics
from math import prod

import pytest
from click.testing import CliRunner

from moerun.bench import bench
from moerun.engine.model import MoEModel
from moerun.models.bench_model import (
    MIXES,
    PRESETS,
    tensor_plan,
    with_layers,
    write_bench_model,
)

COLUMNS = ["model", "size", "params", "backend", "test", "t/s"]
TINY = with_layers(PRESETS["tiny"], 1)
PLAN = tensor_plan(TINY, MIXES["q4_k_m"])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_bench_model(tmp_path_factory.mktemp("bench") / "tiny.gguf", TINY, MIXES["q4_k_m"])


def run_bench(*args):
    return CliRunner().invoke(bench, [str(a) for a in args], catch_exceptions=False)


def table_rows(output: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in output.splitlines() if line.startswith("|")]


def test_markdown_table_has_llama_bench_columns_and_a_row_per_test(model):
    result = run_bench("-m", model, "-p", "16,32", "-n", "4", "-r", "2")
    assert result.exit_code == 0, result.output
    header, rule, *rows = table_rows(result.stdout)
    assert header == COLUMNS
    assert [cell.endswith(":") for cell in rule] == [False, True, True, False, True, True]
    assert [row[4] for row in rows] == ["pp16", "pp32", "tg4"]
    for row in rows:
        assert row[:4] == ["tiny-qwen3moe bench Q4_K_M", row[1], row[2], "CPU"]
        assert re.fullmatch(r"\d+\.\d\d MiB", row[1]) and re.fullmatch(r"\d+\.\d\d M", row[2])
        mean, sd = re.fullmatch(r"(\d+\.\d\d) ± (\d+\.\d\d)", row[5]).groups()
        assert float(mean) > 0 and float(sd) >= 0


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


def test_each_test_runs_the_forward_passes_it_names_on_seeded_valid_tokens(model, monkeypatch):
    """pp8: one 8-token prefill per run; tg3: a 1-token prompt and 3 decode steps per run;
    every run once more untimed; the same token ids on every invocation."""
    calls: list[list[int]] = []
    forward = MoEModel.forward

    def recording_forward(self, ids, cache, all_logits):
        calls.append(list(ids))
        return forward(self, ids, cache, all_logits)

    monkeypatch.setattr(MoEModel, "forward", recording_forward)
    assert run_bench("-m", model, "-p", "8", "-n", "3", "-r", "2").exit_code == 0
    runs = 1 + 2
    assert [len(ids) for ids in calls] == [8] * runs + [1] * (runs * (1 + 3))
    assert all(0 <= i < TINY.vocab for ids in calls for i in ids)
    first = calls[:]
    calls.clear()
    run_bench("-m", model, "-p", "8", "-n", "3", "-r", "2")
    assert [ids for ids in calls if len(ids) == 8] == [ids for ids in first if len(ids) == 8]


@pytest.mark.parametrize("flags, message", [
    (["-p", "0"], "every token count must be at least 1"),
    (["-n", "16,x"], "expected token counts separated by commas"),
    (["-o", "xml"], "'xml' is not one of 'md', 'json'"),
    (["-r", "0"], "0 is not in the range x>=1"),
    (["-p", "16", "-n", "64", "--ctx", "32"], "32 is too small for tg64, which needs 65 positions"),
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


def test_without_a_model_the_error_names_both_places():
    result = run_bench("-p", "8")
    assert result.exit_code == 2
    assert "Missing option -m/--model (or `model` in the --config file)" in result.output


def test_a_missing_model_is_one_error_line(tmp_path):
    result = run_bench("-m", tmp_path / "absent.gguf", "-p", "4", "-n", "2", "-r", "1")
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and "absent.gguf" in result.output

