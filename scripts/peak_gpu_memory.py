"""Peak memory in use on a GPU while a command runs, sampled by nvidia-smi: one measure for any
program (moerun bench, llama-bench), so that their figures compare.

    python scripts/peak_gpu_memory.py -- moerun bench -m M.gguf --device cuda:0 -p 512 -n 128 -r 1
    python scripts/peak_gpu_memory.py --gpu 0 -- llama-bench -m M.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 1

Samples the device's memory.used every --interval-ms while the command runs (its output passes
through), then prints one line: the peak, the device's use before the command (other processes,
nothing of this one), and their difference, in MiB as nvidia-smi counts them. moerun bench's own
"peak MiB" column reads the same figure at the end of each test, not between.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading


def memory_used_mib(gpu: int) -> int:
    out = subprocess.run(["nvidia-smi", "-i", str(gpu), "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         check=True, capture_output=True, text=True).stdout
    return int(out.split()[0])


def sample(gpu: int, interval_ms: int, peak: list[int], stop: threading.Event) -> None:
    """Keeps peak[0] at the largest memory.used nvidia-smi reports until stop is set."""
    sampler = subprocess.Popen(["nvidia-smi", "-i", str(gpu), "--query-gpu=memory.used",
                                "--format=csv,noheader,nounits", f"-lms={interval_ms}"],
                               stdout=subprocess.PIPE, text=True)
    try:
        for line in sampler.stdout:
            if line.strip().isdigit():
                peak[0] = max(peak[0], int(line))
            if stop.is_set():
                break
    finally:
        sampler.kill()
        sampler.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", type=int, default=0, help="nvidia-smi's index of the GPU [default: 0]")
    parser.add_argument("--interval-ms", type=int, default=20, help="sampling interval [default: 20]")
    parser.add_argument("--json", help="also write {command, peak_mib, before_mib, added_mib} to this file")
    parser.add_argument("command", nargs="+", help="the command to run, after --")
    args = parser.parse_args()
    before = memory_used_mib(args.gpu)
    peak, stop = [before], threading.Event()
    thread = threading.Thread(target=sample, args=(args.gpu, args.interval_ms, peak, stop), daemon=True)
    thread.start()
    try:
        status = subprocess.run(args.command).returncode
    finally:
        stop.set()
        thread.join(timeout=5)
    peak[0] = max(peak[0], memory_used_mib(args.gpu))
    result = {"command": args.command, "peak_mib": peak[0], "before_mib": before, "added_mib": peak[0] - before}
    print(f"peak GPU memory: {peak[0]} MiB in use ({before} MiB before the command, {peak[0] - before} MiB added): "
          f"{' '.join(args.command)}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    sys.exit(status)


if __name__ == "__main__":
    main()
