"""The kernels of a CUDA program's decode steps, timed on the GPU as they really ran (graph
replays and overlapping launches included), without Nsight Systems: builds cupti_trace.c
into an injection library, runs the command under it, then splits the trace into steps at
the GPU's idle pauses (a decode step ends with the host reading its logits) and prints what
one step spends, kernel by kernel.

    python3 scripts/timeline/trace.py --per 48 -- moerun bench -m M.gguf -p 0 -n 32 -r 1
    python3 scripts/timeline/trace.py --per 48 -- llama-bench -m M.gguf -p 0 -n 32 -r 1

The last --steps steps before the final one are read. Per step: "span" from its first kernel's
start to its last kernel's end, "busy" the time some kernel ran within it (span - busy: the GPU
idle between its kernels), "cycle" to the next step's first kernel (what tokens/s sees). Each
kernel is charged the time from the previous kernel's end to its own end: a kernel that
started early (a programmatic dependent launch waiting for the one before) is charged only
for what it added to the chain.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
CUDA_ROOTS = ("/usr/local/cuda", "/usr/local/cuda/extras/CUPTI", "/usr")


def find(relative: str) -> Path:
    for root in CUDA_ROOTS:
        for candidate in Path(root).glob(relative):
            return candidate
    sys.exit(f"{relative} not found under {', '.join(CUDA_ROOTS)}: install CUDA's CUPTI")


def build(out: Path) -> Path:
    include = find("include/cupti.h").parent
    library = find("lib*/libcupti.so").parent
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", f"-I{include}", str(HERE / "cupti_trace.c"), "-o", str(out),
                    f"-L{library}", "-lcupti", f"-Wl,-rpath,{library}"], check=True)
    return out


def read(path: Path) -> list[tuple[int, int, str]]:
    kernels = []
    for line in path.read_text().splitlines():
        start, end, name = line.split(" ", 2)
        kernels.append((int(start), int(end), name))
    return sorted(kernels)


def steps_of(kernels: list, gap_ns: int, n_steps: int) -> tuple[list[list], list[int]]:
    """The last n_steps runs of kernels separated by idle pauses longer than gap_ns (the final
    run left out), and where the run after each starts. Runs of at most a quarter of the
    longest run's kernels (the host's small fills between steps) are not steps: they fall in
    the cycle of the step before."""
    runs, reach = [[]], 0
    for kernel in kernels:
        if runs[-1] and kernel[0] - reach > gap_ns:
            runs.append([])
        runs[-1].append(kernel)
        reach = max(reach, kernel[1])
    longest = max(len(run) for run in runs)
    steps = [run for run in runs if len(run) * 4 > longest]
    if len(steps) < n_steps + 1:
        sys.exit(f"the trace has {len(steps)} steps: fewer than --steps + 1")
    chosen = steps[-(n_steps + 1):]
    return chosen[:-1], [run[0][0] for run in chosen[1:]]


def busy_ns(step: list) -> int:
    total, reach = 0, 0
    for start, end, _ in step:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def demangled(names: set[str]) -> dict[str, str]:
    """C++ kernel names as c++filt reads them (where it is installed), without their
    parameter lists or a leading 'void '."""
    names = sorted(names)
    readable = names
    if shutil.which("c++filt"):
        readable = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                                  check=True).stdout.splitlines()
    return {name: without_parameters(text).removeprefix("void ") for name, text in zip(names, readable)}


def without_parameters(name: str) -> str:
    depth = 0
    for at in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[at], 0)
        if depth == 0:
            return name[:at] if name.endswith(")") else name
    return name


def short(name: str) -> str:
    return name if len(name) <= 70 else name[:67] + "..."


def report(steps: list[list], next_starts: list[int], per: int) -> str:
    cycle = sum(b - step[0][0] for step, b in zip(steps, next_starts)) / len(steps) / 1e3
    span = sum(max(end for _, end, _ in step) - step[0][0] for step in steps) / len(steps) / 1e3
    busy = sum(busy_ns(step) for step in steps) / len(steps) / 1e3
    by_name = collections.defaultdict(list)
    readable = demangled({name for step in steps for _, _, name in step})
    for step in steps:
        reach = step[0][0]
        for start, end, name in step:
            by_name[short(readable[name])].append(max(end - reach, 0) / 1e3)
            reach = max(reach, end)
    lines = [f"per step: cycle {cycle:.1f} µs ({1e6 / cycle:.1f} steps/s), span {span:.1f} µs, kernels busy "
             f"{busy:.1f} µs (idle within the span {span - busy:.1f} µs); "
             f"{sum(len(s) for s in steps) / len(steps):.0f} kernels",
             "", f"| kernel | per step | µs added each | µs per step | per {per} |", "|---|---:|---:|---:|---:|"]
    rows = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    for name, times in rows:
        per_step = sum(times) / len(steps)
        lines.append(f"| {name} | {len(times) / len(steps):.0f} | {sum(times) / len(times):.2f} | "
                     f"{per_step:.1f} | {per_step / per:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gap-us", type=float, default=20.0, help="an idle pause longer than this ends a step")
    parser.add_argument("--steps", type=int, default=16, help="how many of the last steps to read")
    parser.add_argument("--per", type=int, default=1, help="also show each kernel's µs per step divided by this "
                                                           "(the number of layers)")
    parser.add_argument("--trace", type=Path, help="read this trace instead of running a command")
    parser.add_argument("--keep", type=Path, help="copy the raw trace here")
    parser.add_argument("command", nargs="*")
    args = parser.parse_args()
    trace = args.trace
    if trace is None:
        if not args.command:
            parser.error("give a command after --, or --trace")
        folder = Path(tempfile.mkdtemp())
        trace = folder / "trace.txt"
        env = {**os.environ, "CUDA_INJECTION64_PATH": str(build(folder / "libtrace.so")),
               "KERNEL_TRACE_FILE": str(trace)}
        subprocess.run(args.command, env=env, check=True)
    if args.keep:
        shutil.copyfile(trace, args.keep)
    kernels = read(trace)
    steps, next_starts = steps_of(kernels, int(args.gap_us * 1e3), args.steps)
    print(report(steps, next_starts, args.per))


if __name__ == "__main__":
    main()
