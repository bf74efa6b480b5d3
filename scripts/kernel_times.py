"""Sum a kernel profiler's per-launch durations by kernel name.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
        python scripts/profile_gpu.py -m model.gguf -n 2 > ncu.csv
    python scripts/kernel_times.py ncu.csv
"""
from __future__ import annotations

import csv
import sys
from collections import defaultdict

UNIT_SCALES = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}   # to µs


def main(path: str) -> None:
    with open(path, newline="") as handle:
        lines = [line for line in handle if line.startswith('"')]
    totals: dict[str, list[float]] = defaultdict(list)
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            scale = UNIT_SCALES[row["Metric Unit"]]
            totals[row["Kernel Name"].split("(")[0][:60]].append(float(row["Metric Value"].replace(",", "")) * scale)
    grand = sum(sum(times) for times in totals.values())
    print(f"{'kernel':60} {'launches':>8} {'total us':>10} {'mean us':>9} {'share':>6}")
    for name, times in sorted(totals.items(), key=lambda item: -sum(item[1])):
        total = sum(times)
        print(f"{name:60} {len(times):8d} {total:10.1f} {total / len(times):9.2f} {100 * total / grand:5.1f}%")


if __name__ == "__main__":
    main(sys.argv[1])
