"""The path of one decode token through a CPU rig stays short: the parent's files whose code runs
while the runtime decodes one token (Runtime._decode and all it calls: the forward pass, the
backend, the dispatcher, the wire to the daemon and back) are at most MAX_FILES — the hops
docs/architecture.md names (backends/cpu/library.py among them where the CPU kernels load: they run the
norms, rope, attention and routing of a float32 model too)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig
from tests.support.daemon_fixtures import GREEDY, PROMPT, tiny_daemon_model

MAX_FILES = 13
REPO = Path(__file__).resolve().parents[2]
PROJECT = tuple(str(REPO / folder) for folder in ("moerun", "ipc", "daemons"))
STEPS = 4


def decode_files(runtime: Runtime) -> list[set[str]]:
    """For each of STEPS decode steps, the project files with code that ran inside Runtime._decode."""
    decode_code = Runtime._decode.__code__
    steps: list[set[str]] = []
    depth = 0

    def profile(frame, event, _arg) -> None:
        nonlocal depth
        if frame.f_code is decode_code and event in ("call", "return"):
            depth += 1 if event == "call" else -1
            if event == "call":
                steps.append(set())
        if depth and event == "call" and frame.f_code.co_filename.startswith(PROJECT):
            steps[-1].add(str(Path(frame.f_code.co_filename).relative_to(REPO)))

    tokens = runtime.generate(PROMPT, STEPS + 1, GREEDY)
    next(tokens)                     # the prefill and the first token: no decode step yet
    sys.setprofile(profile)
    try:
        for _ in tokens:
            pass
    finally:
        sys.setprofile(None)
    return steps


@pytest.mark.parametrize("transport", ["shared", "stream"])
def test_one_decode_token_touches_at_most_thirteen_files(tmp_path, transport):
    model = tiny_daemon_model(tmp_path)
    with Runtime(model, rig=RigConfig(daemons=("cpu",), hot=2, transport=transport)) as runtime:
        steps = decode_files(runtime)
        assert runtime.moe_stats().remote_pairs > 0, "the daemon must have had work"
    assert len(steps) == STEPS
    # a step that meets a cold expert cache or a slow reply reads more (liveness checks, the mmap):
    # the path is what a warm step runs
    path = min(steps, key=len)
    assert "moerun/rig/cpu_dispatch.py" in path and "ipc/client.py" in path
    assert len(path) <= MAX_FILES, sorted(path)
