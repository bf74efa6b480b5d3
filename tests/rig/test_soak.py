"""Soak: 200 short greedy generations in a row while daemons are killed at random moments
every few generations. Every output equals the fault-free one, every kill ends in a rejoin,
and the parent ends with the file descriptors, threads, shared memory and child processes it
started with. How long it takes is measured by scripts/bench_soak.py, not asserted here."""
from __future__ import annotations

import os
import random
import signal
import threading
from pathlib import Path

import pytest

from moerun.engine.runtime import Runtime
from moerun.rig.settings import RigConfig
from tests.support.daemon_fixtures import GREEDY
from tests.support.hf_models import tiny_model
from tests.support.live_processes import REJOIN_TIMEOUT_S, live_children, wait_until
from tests.support.shm_segments import shm_segments
from tests.support.to_gguf import write_gguf

GENERATIONS = 200
KILL_EVERY = (2, 6)              # generations between two kills, drawn at random
KILL_DELAY_S = (0.0, 0.03)       # a kill lands this long after its generation starts: prefill, decode or idle
VOCAB = 320                      # tiny_model's

pytestmark = pytest.mark.slow


def open_resources() -> tuple[int, int, int, int]:
    """(open file descriptors, threads, /dev/shm segments, mapped arenas) of this process."""
    arenas = sum("/dev/shm/moerun-" in line for line in Path("/proc/self/maps").read_text().splitlines())
    return len(os.listdir("/proc/self/fd")), threading.active_count(), len(shm_segments()), arenas


def no_growth(baseline: tuple[int, ...]) -> bool:
    return all(now <= before for now, before in zip(open_resources(), baseline))


def test_200_generations_with_daemons_killed_at_random(tmp_path):
    rng = random.Random(11)
    requests = [([rng.randrange(VOCAB) for _ in range(rng.randint(2, 10))], rng.randint(3, 8))
                for _ in range(GENERATIONS)]
    model = write_gguf(tiny_model("qwen3moe", seed=4), tmp_path / "m.gguf", "F32")
    with Runtime(model) as local:
        expected = [list(local.generate(prompt, n, GREEDY)) for prompt, n in requests]

    with Runtime(model, rig=RigConfig(daemons=("cpu", "cpu"), hot=1, daemon_timeout_s=10)) as runtime:
        links = runtime.rig.links
        assert list(runtime.generate(*requests[0], GREEDY)) == expected[0]   # everything opened once
        baseline = open_resources()
        kills, next_kill = 0, rng.randint(*KILL_EVERY)
        for i, (prompt, n) in enumerate(requests):
            killer = None
            if i == next_kill:
                wait_until(lambda: any(link.up and link.alive() for link in links), REJOIN_TIMEOUT_S, "daemon to kill")
                victim = rng.choice([link for link in links if link.up and link.alive()]).local.process
                killer = threading.Timer(rng.uniform(*KILL_DELAY_S), victim.send_signal, (signal.SIGKILL,))
                killer.start()
                kills, next_kill = kills + 1, i + rng.randint(*KILL_EVERY)
            assert list(runtime.generate(prompt, n, GREEDY)) == expected[i], f"generation {i}"
            if killer is not None:
                killer.join()
        wait_until(lambda: sum(link.rejoins for link in links) == kills and all(link.up for link in links),
                   REJOIN_TIMEOUT_S, f"rejoin after each of the {kills} kills")
        assert sum(link.times_down for link in links) == kills, "each kill took its daemon down once"
        assert sum(link.fallback_calls for link in links) > 0
        wait_until(lambda: no_growth(baseline), REJOIN_TIMEOUT_S, f"return to {baseline} (fds, threads, shm, arenas)")
        assert live_children() == {link.local.process.pid for link in links}, "only the two current daemons run"
