"""The suite's leak checks count this run's arenas only: a moerun running beside it (a second copy
of the suite, a user's rig) keeps its own segments without failing our tests."""
from __future__ import annotations

import subprocess
import sys
import time

from moerun.ipc.shm import Arena, ArenaLayout
from tests.support.shm_segments import SHM_DIR, shm_segments

LAYOUT = ArenaLayout(slots=1, batch_capacity=1, hidden=8, max_pairs_per_token=1)
# A process that is no child of ours: it forks, the middle process exits, the grandchild (adopted
# by init) makes an arena, prints its name and keeps it until its stdin closes.
OUTSIDER = """
import os, sys
if os.fork():
    os._exit(0)
os.setsid()
from moerun.ipc.shm import Arena, ArenaLayout
arena = Arena.create(ArenaLayout(1, 1, 8, 1))
print(arena.name, flush=True)
sys.stdin.read()
arena.close()
arena.unlink()
"""


def test_an_arena_of_this_process_is_ours():
    arena = Arena.create(LAYOUT)
    try:
        assert arena.name in shm_segments()
    finally:
        arena.close()
        arena.unlink()
    assert arena.name not in shm_segments()


def test_an_arena_of_a_live_process_outside_this_run_is_not():
    with subprocess.Popen([sys.executable, "-c", OUTSIDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as outsider:
        try:
            name = outsider.stdout.readline().strip()
            assert (SHM_DIR / name).exists()
            assert name not in shm_segments()
        finally:
            outsider.stdin.close()
        deadline = time.monotonic() + 30
        while (SHM_DIR / name).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not (SHM_DIR / name).exists()
