"""Time the soak of tests/rig/test_soak.py: short greedy generations through two CPU daemons,
one of them killed with SIGKILL every few generations (once one is up to be killed: the wait
for a rejoin counts too); prints the wall time, the generations per second and the rejoins.

    python scripts/bench_soak.py [--generations 200] [--kill-every 2:6] [--seed 11]
"""
import argparse
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.rig.settings import RigConfig
from moerun.writers.synthetic import SyntheticConfig, write_synthetic_model

TINY = SyntheticConfig(name="soak", n_layers=2, hidden=64, n_heads=2, n_kv_heads=1, head_dim=32,
                       n_experts=8, n_experts_used=2, expert_ff=32, vocab_size=320, ftype="F32")
GREEDY = SamplingParams(temperature=0.0)

parser = argparse.ArgumentParser()
parser.add_argument("--generations", type=int, default=200)
parser.add_argument("--kill-every", default="2:6", help="generations between two kills, drawn in A:B")
parser.add_argument("--seed", type=int, default=11)
args = parser.parse_args()
kill_every = tuple(int(n) for n in args.kill_every.split(":"))

rng = random.Random(args.seed)
model = write_synthetic_model(Path(tempfile.mkdtemp(prefix="moerun-soak-")) / "m.gguf", TINY,
                              "daemons die and come back. " * 40, bigram_head=False)
requests = [([rng.randrange(256) for _ in range(rng.randint(2, 10))], rng.randint(3, 8))
            for _ in range(args.generations)]
with Runtime(model, rig=RigConfig(daemons=("cpu", "cpu"), hot=1, daemon_timeout_s=10)) as runtime:
    links = runtime.rig.links
    kills, next_kill = 0, rng.randint(*kill_every)
    started = time.perf_counter()
    for i, (prompt, n) in enumerate(requests):
        killer = None
        if i == next_kill:
            while not (live := [link for link in links if link.up and link.alive()]):
                time.sleep(0.01)
            victim = rng.choice(live).local.process
            killer = threading.Timer(rng.uniform(0.0, 0.03), victim.send_signal, (signal.SIGKILL,))
            killer.start()
            kills, next_kill = kills + 1, i + rng.randint(*kill_every)
        list(runtime.generate(prompt, n, GREEDY))
        if killer is not None:
            killer.join()
    seconds = time.perf_counter() - started
    rejoins = sum(link.rejoins for link in links)
print(f"{args.generations} generations, {kills} kills, {rejoins} rejoins by the end: "
      f"{seconds:.1f} s ({args.generations / seconds:.1f} generations/s)")
