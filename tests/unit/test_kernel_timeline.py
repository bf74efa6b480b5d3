"""scripts/timeline/trace.py reads a kernel trace into decode steps: steps split at the GPU's
idle pauses, the host's small kernels between steps counted with the step before, and each
kernel charged only what it added to the chain (an early-resident dependent launch is not
charged for its wait)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "timeline" / "trace.py"


@pytest.fixture(scope="module")
def trace_module():
    spec = importlib.util.spec_from_file_location("kernel_trace", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_steps(path: Path, n_steps: int) -> None:
    """Steps of four kernels (ns): a 2 µs norm, a 10 µs product that started 1 µs early and
    waited, a 3 µs add after a 1 µs gap, a 1 µs tail; 99 µs of host time, one fill kernel, 50 µs
    more."""
    lines, t = [], 0
    for _ in range(n_steps):
        lines += [f"{t} {t + 2000} norm", f"{t + 1000} {t + 12000} product", f"{t + 13000} {t + 16000} add",
                  f"{t + 16000} {t + 17000} tail"]
        lines.append(f"{t + 116000} {t + 117000} fill")
        t += 167000
    path.write_text("\n".join(lines) + "\n")


def test_steps_are_split_at_idle_pauses_with_each_kernel_charged_what_it_added(trace_module, tmp_path):
    path = tmp_path / "trace.txt"
    write_steps(path, 6)
    steps, next_starts = trace_module.steps_of(trace_module.read(path), 20_000, 4)
    assert [len(step) for step in steps] == [4, 4, 4, 4]              # the fills are not steps
    report = trace_module.report(steps, next_starts, per=1)
    assert "cycle 167.0 µs" in report and "span 17.0 µs" in report and "busy 16.0 µs" in report
    charged = {row.split("|")[1].strip(): float(row.split("|")[3]) for row in report.splitlines()
               if row.startswith("| ") and "kernel" not in row}
    assert charged == {"norm": 2.0, "product": 10.0, "add": 4.0, "tail": 1.0}


def test_too_short_a_trace_is_refused(trace_module, tmp_path):
    path = tmp_path / "trace.txt"
    write_steps(path, 3)
    result = subprocess.run([sys.executable, str(SCRIPT), "--trace", str(path), "--steps", "8"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "fewer than --steps + 1" in result.stderr
