"""llama.cpp's flags where moerun means the same (aliases that give the same output as moerun's own
names), a clear refusal of those it does not take, and its closing timing line."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from moerun.commands.llama_flags import FOREIGN_FLAGS
from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.writers.demo import demo_model_path

GREEDY = ("--temp", "0")


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    os.environ["MOERUN_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    return str(demo_model_path())


def test_short_aliases_give_the_same_run(demo_model, moerun, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The rig")
    long = moerun("run", "-m", demo_model, "-p", "The rig", "-n", "12", "--ctx", "64", "--threads", "1",
                  "--seed", "9", "--ubatch", "2")
    short = moerun("run", "-m", demo_model, "-f", prompt, "-n", "12", "-c", "64", "-t", "1", "-s", "9", "-ub", "2")
    assert long.exit_code == short.exit_code == 0, short.output
    assert long.stdout == short.stdout and long.stdout.strip()


def test_the_prompt_is_given_once(demo_model, moerun, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("x")
    result = moerun("run", "-m", demo_model, "-p", "x", "-f", prompt)
    assert result.exit_code == 2 and "-p TEXT or -f FILE" in result.output


def test_ignore_eos_generates_every_token(demo_model, moerun):
    with Runtime(demo_model) as runtime:
        tokenizer = runtime.tokenizer
        ids = tokenizer.encode("The rig")
        greedy = SamplingParams(temperature=0.0, banned_ids=tokenizer.stop_ids)
        tokens = list(runtime.generate(ids, 40, greedy, tokenizer.stop_ids))
        expected = tokenizer.decode(tokens)
    assert len(tokens) == 40 and not set(tokens) & tokenizer.stop_ids
    result = moerun("run", "-m", demo_model, "-p", "The rig", "-n", "40", "--ignore-eos", *GREEDY)
    assert result.exit_code == 0, result.output
    assert result.stdout == expected + "\n"
    assert "40 tokens generated" in result.stderr


def test_system_prompt_renders_through_the_chat_template(demo_model, moerun):
    with_system = moerun("run", "-m", demo_model, "-sys", "Be brief.", "-p", "The rig", "-n", "8", *GREEDY)
    as_chat = moerun("run", "-m", demo_model, "--chat", "-p", "The rig", "-n", "8", *GREEDY)
    assert with_system.exit_code == as_chat.exit_code == 0, with_system.output
    prompt_tokens = [int(re.search(r"prompt eval (\d+) tokens", r.stderr).group(1)) for r in (with_system, as_chat)]
    assert prompt_tokens[0] > prompt_tokens[1]          # the system turn was rendered before the user's


def test_penalties_reach_the_sampler(demo_model, moerun):
    plain = moerun("run", "-m", demo_model, "-p", "The rig", "-n", "30", *GREEDY)
    penalised = moerun("run", "-m", demo_model, "-p", "The rig", "-n", "30", "--frequency-penalty", "2",
                       "--presence-penalty", "2", *GREEDY)
    assert plain.exit_code == penalised.exit_code == 0, penalised.output
    assert plain.stdout != penalised.stdout


def test_n_predict_minus_one_runs_until_the_context_is_full(demo_model, moerun):
    result = moerun("run", "-m", demo_model, "-p", "The rig", "-n", "-1", "-c", "24", "--ignore-eos", *GREEDY)
    assert result.exit_code == 0, result.output
    assert "the context of 24 tokens is full" in result.stderr


def test_the_closing_timing_line(demo_model, moerun):
    result = moerun("run", "-m", demo_model, "-p", "The rig", "-n", "6", "--ignore-eos", *GREEDY)
    line = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"moerun: prompt eval \d+ tokens in [\d.]+ ms \([\d.]+ t/s\); eval 5 runs in [\d.]+ ms "
                        r"\([\d.]+ ms per token, [\d.]+ t/s\); 6 tokens generated", line), line


@pytest.mark.parametrize("args", [("run", "-ngl", "99"), ("bench", "--n-gpu-layers=99"), ("run", "-fa", "1"),
                                  ("serve", "--n-cpu-moe", "24"), ("logits", "-ot", "exps=CPU")])
def test_llama_cpp_flags_moerun_does_not_take_are_explained(moerun, args):
    result = moerun(*args)
    assert result.exit_code == 2
    flag = args[1].split("=")[0]
    assert f"{flag} is a llama.cpp flag moerun does not take: {FOREIGN_FLAGS[flag]}." in result.output


def test_a_foreign_flag_as_an_options_value_is_not_refused(demo_model, moerun):
    result = moerun("run", "-m", demo_model, "-p", "-ngl", "-n", "2", *GREEDY)
    assert result.exit_code == 0, result.output


def test_ctx_beyond_the_trained_context_is_said(demo_model, moerun):
    result = moerun("run", "-m", demo_model, "-n", "1", "-c", "100000", *GREEDY)
    assert result.exit_code == 0, result.output
    assert "--ctx 100000 is beyond the 4096 positions the model was trained on" in result.stderr


def test_a_closed_stdout_ends_the_run_quietly(demo_model):
    """`moerun run | head -c 10`: no error, the status a writer killed by SIGPIPE has."""
    env = {**os.environ, "MOERUN_CACHE": os.environ["MOERUN_CACHE"]}
    command = [sys.executable, "-m", "moerun", "run", "-m", demo_model, "-n", "400", "--ignore-eos", *GREEDY]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as process:
        process.stdout.read(10)
        process.stdout.close()
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 141
    assert b"Error" not in stderr and b"Traceback" not in stderr
