"""Start a CPU daemon on FILE, assign it the upper half of every layer's experts, and time it:
listening, HELLO, READY, resident memory, and 30 one-token passes after a cold or warm start.

    python scripts/bench_daemon_startup.py FILE cold|cold-noprefetch|warm [THREADS]
"""
import ctypes
import mmap
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from moerun.gguf.reader import GGUFFile
from moerun.ipc.client import DaemonClient
from moerun.models import load_spec

path, mode = sys.argv[1], sys.argv[2]          # mode: cold | cold-noprefetch | warm
threads = sys.argv[3] if len(sys.argv) > 3 else "2"
with GGUFFile(path) as gguf:
    spec, fingerprint = load_spec(gguf), gguf.fingerprint()
    experts = {layer: list(range(spec.n_experts // 2, spec.n_experts)) for layer in range(spec.n_layers)}
    ranges = [span for layer, ids in experts.items() for name in spec.expert_tensor_names(layer)
              for span in gguf.expert_ranges(name, ids)]
assigned_gib = sum(length for _, length in ranges) / 2**30
fd = os.open(path, os.O_RDONLY)
if mode.startswith("cold"):
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
else:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
data = np.frombuffer(mapping, np.uint8)
mincore = ctypes.CDLL(None).mincore
mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
pages = np.zeros(-(-len(mapping) // mmap.PAGESIZE), np.uint8)
def resident() -> float:
    mincore(data.ctypes.data, len(mapping), pages.ctypes.data)
    total = sum((pages[s // 4096:-(-(s + n) // 4096)] & 1).sum() for s, n in ranges)
    return total / sum(-(-(s + n) // 4096) - s // 4096 for s, n in ranges)
def rss(pid) -> str:
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    mib = {name: int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "RssAnon", "RssFile")}
    return f"{mib['VmRSS']:.0f} MiB ({mib['RssAnon']:.0f} anonymous, {mib['RssFile']:.0f} of the file)"
sock = os.path.join(tempfile.mkdtemp(prefix="moerun-startup-"), "d.sock")
prelude = "from moerun.gguf.reader import GGUFFile; GGUFFile.will_need = lambda self, ranges: None; " \
    if mode == "cold-noprefetch" else ""
t0 = time.perf_counter()
daemon = subprocess.Popen([sys.executable, "-c", prelude + "from moerun.cli import main; main()", "daemon", "-m", path,
                           "--listen", f"ipc://{sock}", "--threads", threads], stderr=subprocess.DEVNULL)
while not os.path.exists(sock):
    time.sleep(0.005)
t_listen = time.perf_counter() - t0
with DaemonClient(f"ipc://{sock}", connect_timeout_s=120) as client:
    client.hello(fingerprint)
    t_hello = time.perf_counter() - t0
    client.assign(experts)
    t_ready = time.perf_counter() - t0
    rss_ready = rss(daemon.pid)
    at_ready = resident()
    rng = np.random.default_rng(0)
    def one_token_pass() -> float:
        started = time.perf_counter()
        for layer in range(spec.n_layers):
            ids = rng.choice(spec.n_experts // 2, 8, replace=False)
            x = rng.standard_normal((1, spec.hidden)).astype(np.float32)
            client.wait(client.submit(layer, x, np.array([8]), ids, np.full(8, 0.125, np.float32), "f32"), 60)
        return time.perf_counter() - started
    done = []
    for _ in range(30):
        one_token_pass()
        done.append(time.perf_counter() - t0)
    share = resident()
    rss_after = rss(daemon.pid)
    steady = min(one_token_pass() for _ in range(3))
    client.shutdown()
daemon.wait(30)
print(f"{mode}: listening {t_listen:.2f} s, HELLO {t_hello:.2f} s, READY {t_ready:.2f} s, RSS at READY "
      f"{rss_ready}; assigned {assigned_gib:.2f} GiB, {100 * at_ready:.0f}% in the page cache at READY; "
      f"1-token passes over 48 layers done at {done[0]:.1f} / {done[9]:.1f} / {done[29]:.1f} s (1st / 10th / 30th), "
      f"{100 * share:.0f}% in the page cache then; a pass then {1000 * steady:.0f} ms; RSS then {rss_after}")
