"""moerun's CPU backend against llama-cpp-python's CPU build on one small file: prompt
processing (pp) and generation (tg) tokens/s at the same thread count, in one table.

    python scripts/bench_vs_llama_cpp_python.py                       # 4-layer file, 2 threads
    python scripts/bench_vs_llama_cpp_python.py -m FILE.gguf --threads 16 -r 5
    python scripts/bench_vs_llama_cpp_python.py -d 4096                 # after 4096 tokens of context
    python scripts/bench_vs_llama_cpp_python.py -d 4096 --cache-type q8_0   # both KV caches q8_0

A script for the CI machine (2 cores), not a test: nothing in the test suite runs it.

llama-cpp-python comes from `--venv` (a virtual environment of its own, so that moerun's does
not change): where `import llama_cpp` fails there, the venv is made and llama-cpp-python
`--llama-version` is installed into it from source with a plain CPU build
(CMAKE_ARGS="-DGGML_NATIVE=ON": ggml built for this CPU, no GPU backend; on a CPU with AMX the
instruction sets are named one by one instead, AMX left out: ggml's AMX path dies with SIGSEGV at
its first evaluation on the 2-core CI-sized VM, also with -DGGML_NATIVE=ON and the AMX options
off, which native builds ignore). That compiles
llama.cpp: about 5 minutes on the 2-core dev machine (0.3.36, gcc 12), once.

Without -m, the file is `scripts/make_bench_model.py --layers 4` (the Qwen3-30B-A3B shape,
Q4_K_M-like, 1.9 GiB), written to --model-path unless it is there already.

Both sides start from an empty context on random token ids:
- pp<N>: N prompt tokens in one batch (llama-cpp-python: n_batch = n_ubatch = N; moerun:
  `moerun bench -p N`, one ubatch), the logits of the last;
- tg<N>: after a 1-token prompt, N single-token steps (moerun: greedy decode steps;
  llama-cpp-python: one `eval` of one token each, the next token drawn at random: the
  sampling it leaves out is one argmax over the vocabulary's logits, tens of microseconds).
At a depth D (-d): both go on from D random tokens already in the sequence, prefilled once,
untimed, their state restored before each run (llama-cpp-python: save_state / load_state;
moerun: `moerun bench -d D`), as llama-bench's --n-depth does.
One warm-up run of each test, then -r timed runs; the table shows their mean. With --rounds N
the two sides run in turn N times (llama-cpp-python, moerun, llama-cpp-python, ...), so that a
shared machine's passing load falls on both; the table shows the mean over every round and each
round's ratio.
KV caches: llama.cpp's default (f16) and moerun's CPU default (f32), or both --cache-type
(llama-cpp-python with flash attention, which its quantized value caches need).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import venv
from collections import defaultdict
from pathlib import Path
from statistics import fmean

ROOT = Path(__file__).resolve().parent.parent
GGML_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7}    # ggml type ids of KV caches
# /proc/cpuinfo flag -> ggml's CMake option, for a build that names them (CPUs with AMX)
GGML_ISA_OPTIONS = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2",
                    "avx_vnni": "AVX_VNNI", "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI",
                    "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16"}


def cpu_build() -> str:
    """CMAKE_ARGS of llama-cpp-python's CPU build for this machine (see the docstring above)."""
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()[2:])
    except (OSError, StopIteration):
        return "-DGGML_NATIVE=ON"
    if "amx_int8" not in flags:
        return "-DGGML_NATIVE=ON"
    return " ".join(["-DGGML_NATIVE=OFF"] + [f"-DGGML_{option}={'ON' if flag in flags else 'OFF'}"
                                             for flag, option in GGML_ISA_OPTIONS.items()])


def llama_side(args: argparse.Namespace) -> None:
    """Runs in the llama-cpp-python venv: prints {test: [seconds of each timed run]} as JSON."""
    import llama_cpp

    types = {"type_k": GGML_TYPES[args.cache_type], "type_v": GGML_TYPES[args.cache_type],
             "flash_attn": True} if args.cache_type else {}
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=args.depth + args.prompt + args.gen + 16,
                          n_batch=args.prompt, n_ubatch=args.prompt, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False, **types)
    rng = random.Random(0)
    vocab = llm.n_vocab()
    llm.reset()
    if args.depth:
        llm.eval([rng.randrange(vocab) for _ in range(args.depth)])
    context = llm.save_state()

    def prompt_seconds() -> float:
        llm.load_state(context)
        ids = [rng.randrange(vocab) for _ in range(args.prompt)]
        started = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - started

    def generation_seconds() -> float:
        llm.load_state(context)
        llm.eval([rng.randrange(vocab)])
        started = time.perf_counter()
        for _ in range(args.gen):
            llm.eval([rng.randrange(vocab)])
        return time.perf_counter() - started

    runs = {}
    for name, run in ((f"pp{args.prompt}", prompt_seconds), (f"tg{args.gen}", generation_seconds)):
        run()
        runs[test_name(name, args.depth)] = [run() for _ in range(args.repetitions)]
    print(json.dumps(runs))


def test_name(name: str, depth: int) -> str:
    """As llama-bench and `moerun bench` name a test: pp512, or pp512 @ d4096 at a depth."""
    return f"{name} @ d{depth}" if depth else name


def llama_python(venv_dir: Path, version: str) -> Path:
    """The venv's python, llama-cpp-python installed there (built first if it is missing or was
    built with other CMAKE_ARGS, which the venv's BUILD_ARGS file records)."""
    python, build, record = venv_dir / "bin" / "python", cpu_build(), venv_dir / "BUILD_ARGS"
    if (python.exists() and record.exists() and record.read_text() == build
            and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0):
        return python
    print(f"building llama-cpp-python {version} (CPU, CMAKE_ARGS={build}) into {venv_dir}: "
          f"about 5 minutes on 2 cores", file=sys.stderr)
    venv.create(venv_dir, with_pip=True)
    subprocess.run([python, "-m", "pip", "install", "--no-cache-dir", "--force-reinstall", "--no-deps",
                    f"llama-cpp-python=={version}"], env={**os.environ, "CMAKE_ARGS": build}, check=True)
    subprocess.run([python, "-m", "pip", "install", "--no-cache-dir", f"llama-cpp-python=={version}"], check=True)
    record.write_text(build)
    return python


def bench_model(path: Path) -> Path:
    if not path.exists():
        subprocess.run([sys.executable, ROOT / "scripts" / "make_bench_model.py", "-o", path, "--layers", "4"],
                       check=True)
    return path


def moerun_side(args: argparse.Namespace) -> dict[str, list[float]]:
    """{test: [tokens/s of each timed run]} from `moerun bench -o json`."""
    command = [sys.executable, "-m", "moerun", "bench", "-m", args.model, "--device", "cpu",
               "--threads", str(args.threads), "-p", str(args.prompt), "-n", str(args.gen), "-d", str(args.depth),
               "-r", str(args.repetitions), "-o", "json",
               *(("-ctk", args.cache_type, "-ctv", args.cache_type) if args.cache_type else ())]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return {test["test"]: test["samples_tokens_per_second"] for test in json.loads(done.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", help="GGUF file [default: a 4-layer bench model at --model-path]")
    parser.add_argument("--model-path", default="/tmp/moerun-bench-4-layers.gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-p", "--prompt", type=int, default=512, help="prompt tokens (pp)")
    parser.add_argument("-n", "--gen", type=int, default=128, help="generated tokens (tg)")
    parser.add_argument("-d", "--depth", type=int, default=0, help="tokens of context before each test")
    parser.add_argument("-r", "--repetitions", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="both sides this many times, in turn")
    parser.add_argument("--cache-type", choices=sorted(GGML_TYPES), default=None,
                        help="both sides' KV cache keys and values [default: each side's own]")
    parser.add_argument("--venv", default=str(Path.home() / ".cache" / "moerun" / "llama-cpp-python"),
                        help="llama-cpp-python's virtual environment (made where it lacks llama_cpp)")
    parser.add_argument("--llama-version", default="0.3.36")
    parser.add_argument("--llama-side", action="store_true", help=argparse.SUPPRESS)   # run in the venv
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be 1 or more (got {args.rounds})")
    if args.llama_side:
        llama_side(args)
        return
    args.model = str(Path(args.model) if args.model else bench_model(Path(args.model_path)))
    python = llama_python(Path(args.venv), args.llama_version)
    llama_command = [python, __file__, "--llama-side", "-m", args.model, "--threads", str(args.threads),
                     "-p", str(args.prompt), "-n", str(args.gen), "-d", str(args.depth), "-r", str(args.repetitions),
                     *(("--cache-type", args.cache_type) if args.cache_type else ())]
    rates = {"llama": defaultdict(list), "moerun": defaultdict(list)}      # side -> test -> [mean t/s a round]
    for _ in range(args.rounds):
        for test, seconds in llama_run(llama_command, python).items():
            tokens = args.prompt if test.startswith("pp") else args.gen
            rates["llama"][test].append(fmean([tokens / s for s in seconds]))
        for test, samples in moerun_side(args).items():
            rates["moerun"][test].append(fmean(samples))

    depth = f", after {args.depth} tokens of context" if args.depth else ""
    cache = f", KV caches {args.cache_type}" if args.cache_type else ""
    rounds = f", {args.rounds} rounds in turn" if args.rounds > 1 else ""
    print(f"{Path(args.model).name}, {args.threads} threads{depth}{cache}, {args.repetitions} timed runs each "
          f"(mean){rounds}\n")
    print("| test | moerun t/s | llama-cpp-python t/s | moerun / llama | each round |")
    print("|---|---:|---:|---:|---|")
    for test, llama in rates["llama"].items():
        ours = rates["moerun"][test]
        each = ", ".join(f"{a / b:.2f}" for a, b in zip(ours, llama))
        print(f"| {test} | {fmean(ours):.1f} | {fmean(llama):.1f} | {fmean(ours) / fmean(llama):.2f} | {each} |")


def llama_run(command: list, python: Path) -> dict[str, list[float]]:
    """One run of the llama-cpp-python side: {test: [seconds of each timed run]}."""
    llama = subprocess.run(command, capture_output=True, text=True)
    if llama.returncode:
        how = f"signal {-llama.returncode}" if llama.returncode < 0 else f"status {llama.returncode}"
        raise SystemExit(f"Error: llama-cpp-python's side ended with {how} ({python}); its last output:\n"
                         + "\n".join(llama.stderr.splitlines()[-5:]))
    return json.loads(llama.stdout)


if __name__ == "__main__":
    main()
