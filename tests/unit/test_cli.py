"""The moerun command line end to end, in-process through click's runner."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.reader import GGUFFile
from moerun.writers.bench_model import MIXES, PRESETS, write_bench_model
from moerun.writers.demo import DESCRIPTION, demo_model_path


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    import os
    os.environ["MOERUN_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    return demo_model_path()


@pytest.mark.slow
def test_run_without_arguments_uses_the_demo_model(moerun, tmp_path, monkeypatch):
    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path / "fresh-cache"))
    result = moerun("run", "-n", "24", "--seed", "1")
    assert result.exit_code == 0, result.output
    assert DESCRIPTION in result.stderr
    assert len(result.stdout.strip()) > 0
    assert (tmp_path / "fresh-cache").glob("*.gguf")


def test_demo_model_is_deterministic(tmp_path):
    import os
    paths = []
    for name in ("a", "b"):
        os.environ["MOERUN_CACHE"] = str(tmp_path / name)
        paths.append(demo_model_path())
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_demo_text_echoes_its_corpus(demo_model):
    """The bigram head makes sampled text follow token pairs of the built-in text."""
    from importlib.resources import files
    runtime = Runtime(demo_model)
    corpus = runtime.tokenizer.encode(files("moerun.writers").joinpath("demo_corpus.txt").read_text())
    corpus_pairs = set(zip(corpus, corpus[1:]))
    prompt = runtime.tokenizer.encode("The parent")
    ids = prompt + list(runtime.generate(prompt, 60, SamplingParams(seed=3)))
    pairs = list(zip(ids, ids[1:]))
    assert sum(pair in corpus_pairs for pair in pairs) >= 0.9 * len(pairs)


def test_greedy_run_streams_what_the_runtime_generates(demo_model, moerun):
    result = moerun("run", "-m", demo_model, "-p", "The rig", "--temp", "0", "-n", "20")
    assert result.exit_code == 0, result.output
    runtime = Runtime(demo_model)
    ids = runtime.tokenizer.encode("The rig")
    expected = runtime.tokenizer.decode(list(runtime.generate(ids, 20, SamplingParams(temperature=0.0),
                                                              runtime.tokenizer.stop_ids)))
    assert result.stdout == expected + "\n"


def test_seed_makes_sampling_reproducible(demo_model, moerun):
    runs = [moerun("run", "-m", demo_model, "-n", "30", "--seed", str(seed)).stdout for seed in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]


def test_stats_and_stats_json(demo_model, moerun, tmp_path):
    path = tmp_path / "stats.json"
    result = moerun("run", "-m", demo_model, "-n", "10", "--seed", "0", "--stats", "--stats-json", path)
    assert result.exit_code == 0, result.output
    assert "prefill:" in result.stderr and "tokens/s" in result.stderr
    stats = json.loads(path.read_text())
    assert stats["prompt_tokens"] > 0 and stats["seed"] == 0
    assert stats["generated_tokens"] <= 10 and stats["decode_tokens_per_second"] > 0


def test_chat_prompt_uses_the_template(demo_model, moerun):
    result = moerun("run", "-m", demo_model, "--chat", "-p", "hello", "-n", "5", "--seed", "1")
    assert result.exit_code == 0, result.output


def test_chat_reads_turns_from_stdin(demo_model):
    from click.testing import CliRunner

    from moerun.cli import main
    result = CliRunner().invoke(main, ["run", "-m", str(demo_model), "--chat", "-n", "4", "--seed", "2"],
                                input="first question\n\nsecond question\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("\n") == 2       # one reply line per non-empty turn


def test_logits_writes_every_position(demo_model, moerun, tmp_path):
    out = tmp_path / "logits.npy"
    result = moerun("logits", "-m", demo_model, "--ids", "1,2,3,4", "-o", out)
    assert result.exit_code == 0, result.output
    logits = np.load(out)
    with GGUFFile(demo_model) as gguf:
        vocab = gguf.tensor("token_embd.weight").shape[0]
    assert logits.shape == (4, vocab) and logits.dtype == np.float32


@pytest.mark.parametrize("args, phrase", [
    (["--ids", "1,x,3"], "comma-separated integers"),
    (["--ids", ""], "prompt is empty"),
    (["--ids", "1,999999"], "outside the vocabulary"),
    (["--ids", "1,2,3", "--ctx", "2"], "raise --ctx"),
    (["--ids", "1,2", "--ubatch", "0"], "--ubatch"),
])
def test_logits_bad_arguments(demo_model, moerun, tmp_path, args, phrase):
    result = moerun("logits", "-m", demo_model, "-o", tmp_path / "x.npy", *args)
    assert result.exit_code != 0
    assert phrase in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x.npy").exists()


@pytest.mark.parametrize("args, flag", [
    (["--top-p", "0"], "--top-p"), (["--top-p", "2"], "--top-p"),
    (["--min-p", "2"], "--min-p"), (["--min-p", "-0.1"], "--min-p"),
    (["--repeat-penalty", "0"], "--repeat-penalty"),
    (["--temp", "-1"], "--temp"),
    (["--seed", "-5"], "-s' / '--seed"), (["--seed", str(2**32)], "-s' / '--seed"),
    (["-n", "-2"], "-n"), (["--presence-penalty", "3"], "--presence-penalty"),
    (["--frequency-penalty", "-2.5"], "--frequency-penalty"),
])
def test_run_bad_sampling_flags_are_refused_naming_the_flag(demo_model, moerun, args, flag):
    """Before anything loads: one usage error that names the flag, no traceback."""
    result = moerun("run", "-m", demo_model, *args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"Invalid value for '{flag}" in result.stderr


def test_a_quantized_kv_cache_on_a_gpu_parent_is_a_clear_error(demo_model, moerun):
    result = moerun("run", "-m", demo_model, "--device", "cuda:0", "-ctk", "q8_0", "-ctv", "q8_0", "-n", "1")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.startswith("Error: KV cache types q8_0 (keys) and q8_0 (values): a GPU parent keeps both "
                                    "in one of f16, f32")


def test_plan_counts_a_quantized_cpu_cache_and_refuses_one_on_a_gpu(demo_model, moerun, tmp_path):
    out = tmp_path / "p.json"
    planned = moerun("plan", "-m", demo_model, "--device", "cpu=8GiB", "--ctx", "4096", "-ctk", "q8_0", "-ctv", "q8_0",
                     "-o", out)
    assert planned.exit_code == 0, planned.output
    kv = 4 * 2 * 2 * 64 // 32 * 34                    # layers · kv heads · (K + V) · 64 dims as q8_0 blocks
    assert f"KV cache: 4096 tokens at q8_0 ({4096 * kv / 2**20:.1f} MiB)" in planned.stdout
    refused = moerun("plan", "-m", demo_model, "--device", "cuda:0=8GiB", "--ctx", "4096", "-ctk", "q8_0", "-o", out)
    assert refused.exit_code == 1 and refused.stderr.startswith("Error: KV cache types q8_0 (keys) and f16 (values)")


def test_output_to_a_missing_directory_is_a_clear_error(demo_model, moerun, tmp_path):
    result = moerun("logits", "-m", demo_model, "--ids", "1,2", "-o", tmp_path / "no" / "such" / "dir.npy")
    assert result.exit_code == 1 and result.stderr.startswith("Error: ") and "Traceback" not in result.output


def test_full_device_is_a_clear_error(demo_model, moerun):
    """/dev/full fails every write with ENOSPC."""
    result = moerun("logits", "-m", demo_model, "--ids", "1,2", "-o", "/dev/full")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.startswith("Error: ") and "No space left on device" in result.stderr


def test_write_failure_leaves_no_partial_file(demo_model, tmp_path):
    """A real failed write (file size limit, as on a full disk) keeps no torn or temp file. The
    CPU kernels are built (or found in the cache) before the limit, which a compiler would hit."""
    limit = 1000                                       # bytes; the logits need more
    code = ("import resource, signal, sys; from moerun.backends.cpu.build import library_path; library_path(); "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
            "from moerun.cli import main; sys.argv[0] = 'moerun'; main()")
    out = tmp_path / "logits.npy"
    result = subprocess.run([sys.executable, "-c", code, "logits", "-m", str(demo_model), "--ids", "1,2,3",
                             "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("Error: ") and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_inspect_reports_sizes(demo_model, moerun):
    result = moerun("inspect", demo_model)
    assert result.exit_code == 0, result.output
    with GGUFFile(demo_model) as gguf:
        per_expert = gguf.tensor("blk.0.ffn_down_exps.weight").nbytes * 3 // 8
    assert "qwen3moe" in result.stdout and "8, 2 per token" in result.stdout
    assert f"{per_expert / 1024:.2f} KiB" in result.stdout
    kv_f16 = 4 * 2 * (64 + 64) * 2                    # layers * kv heads * (K + V head dims) * bytes
    assert f"KV cache per token: {kv_f16 / 1024:.2f} KiB at f16" in result.stdout


def test_inspect_describes_a_hybrid_model(tmp_path, moerun):
    path = write_bench_model(tmp_path / "hybrid.gguf", PRESETS["tiny-hybrid"], MIXES["q4_k_m"])
    result = moerun("inspect", path)
    assert result.exit_code == 0, result.output
    assert "qwen35moe" in result.stdout and "rope over 16, gated output" in result.stdout
    assert "DeltaNet:      3 layers (attention in [3]), 2 key and 4 value heads of 64/64, conv 4" in result.stdout
    kv_f16 = 1 * 2 * (64 + 64) * 2                    # one attention layer * kv heads * (K + V) * bytes
    assert f"KV cache per token: {kv_f16} B at f16" in result.stdout
    assert "its 1 of 4 layers with attention" in result.stdout


def test_a_full_context_is_said_not_silent(demo_model, moerun):
    result = moerun("run", "-m", demo_model, "--ctx", "4", "-n", "10", "--temp", "0", "-p", "The")
    assert result.exit_code == 0
    assert "the context of 4 tokens is full (raise --ctx)" in result.stderr


@pytest.mark.parametrize("command", [
    ["inspect"],
    ["profile", "-f", "{prompts}", "-o", "{out}/hotness.csv", "-n", "2"],
    ["plan", "--device", "cpu=8GiB", "--daemon", "cpu=8GiB", "--ctx", "64", "-o", "{out}/placement.json"],
])
def test_every_command_without_a_model_uses_the_demo_model(demo_model, moerun, tmp_path, command):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The experts\n")
    result = moerun(*[part.format(prompts=prompts, out=tmp_path) for part in command])
    assert result.exit_code == 0, result.output
    assert "built-in demo model" in result.stderr


def test_hot_that_leaves_a_daemon_nothing_says_so(demo_model, moerun):
    result = moerun("run", "-m", demo_model, "--hot", "99", "--daemon", "cpu", "-n", "1", "--stats")
    assert result.exit_code == 0, result.output
    assert ("daemon d0 cpu holds no experts (--hot 99 keeps them all on the parent and the other daemons): "
            "it stays idle") in result.stderr


def test_a_placement_file_without_its_daemons_is_refused(demo_model, moerun, tmp_path):
    placement = tmp_path / "placement.json"
    planned = moerun("plan", "-m", demo_model, "--device", "cpu=8GiB", "--daemon", "cpu=8GiB", "--ctx", "64",
                     "-o", placement)
    assert planned.exit_code == 0, planned.output
    result = moerun("run", "-m", demo_model, "--placement", placement, "-n", "1")
    assert result.exit_code == 1
    assert f"--placement {placement} places experts on daemons, but no --daemon" in result.stderr
    two = moerun("run", "-m", demo_model, "--placement", placement, "--daemon", "cpu", "--daemon", "cpu", "-n", "1")
    assert two.exit_code == 1
    assert "was made for 1 daemon (cpu) but the rig has 2 daemons (cpu, cpu)" in two.stderr
