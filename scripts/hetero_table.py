"""Markdown tables from the JSON files scripts/bench_hetero.sh writes (`moerun bench -o json`).

    python3 scripts/hetero_table.py hetero-results

Files: local.json (all experts on the parent) and <transport>-<mode>-<share>.json (share: percent
of each layer's experts on the daemon). The first table has a row per configuration and test:
t/s, t/s as a ratio of the all-local run's, and the daemons' IPC per repetition; the second
compares stream-mode prefill with batched prefill per transport and share.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

NAME = re.compile(r"(?P<transport>\w+)-(?P<mode>batched|stream)-(?P<share>\d+)")
LOCAL = "local"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    directory = parser.parse_args().directory
    runs = load_runs(directory)            # (transport, mode, share) -> {test name: bench document}
    if not runs:
        sys.exit(f"no bench JSON files in {directory}")
    local = runs.get((LOCAL, LOCAL, 0), {})
    print(results_table(runs, local))
    comparison = stream_vs_batched(runs)
    if comparison:
        print()
        print(comparison)
    missing = sorted(log for log in directory.glob("*.log") if not log.with_suffix(".json").exists())
    if missing:
        print()
    for log in missing:
        print(f"no result for {log.stem} (see {log})")


def load_runs(directory: Path) -> dict[tuple[str, str, int], dict[str, dict]]:
    runs = {}
    for path in sorted(directory.glob("*.json")):
        if path.stem == LOCAL:
            key = (LOCAL, LOCAL, 0)
        elif match := NAME.fullmatch(path.stem):
            key = (match["transport"], match["mode"], int(match["share"]))
        else:
            continue
        runs[key] = {test["test"]: test for test in json.loads(path.read_text())}
    return runs


def results_table(runs: dict, local: dict[str, dict]) -> str:
    lines = ["| transport | mode | daemon share | test | t/s | × local | calls | MiB | wait ms | daemon ms |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (transport, mode, share), tests in sorted(runs.items(), key=lambda item: _order(item[0])):
        for name, test in sorted(tests.items()):
            rate = test["tokens_per_second"]
            ratio = _ratio(rate, local[name]["tokens_per_second"]) if name in local else "-"
            daemons = test.get("daemons")
            ipc = ["-"] * 4 if daemons is None else [
                f"{daemons['calls']:.0f}", f"{daemons['mib']:.1f}", f"{daemons['wait_ms']:.1f}",
                "-" if daemons["daemon_ms"] is None else f"{daemons['daemon_ms']:.1f}"]
            label = ("all local", "-") if transport == LOCAL else (transport, mode)
            lines.append("| " + " | ".join([*label, f"{share}%", name,
                                            f"{rate:.2f} ± {test['tokens_per_second_sd']:.2f}", ratio, *ipc]) + " |")
    return "\n".join(lines)


def stream_vs_batched(runs: dict) -> str:
    """Prefill tests run in both modes: stream's calls and seconds as multiples of batched's."""
    lines = ["| transport | daemon share | test | calls batched | calls stream | calls × | ms batched | ms stream "
             "| time × |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (transport, mode, share), batched in sorted(runs.items(), key=lambda item: _order(item[0])):
        stream = runs.get((transport, "stream", share))
        if mode != "batched" or stream is None:
            continue
        for name in sorted(set(batched) & set(stream)):
            if not name.startswith("pp"):
                continue
            calls = (batched[name]["daemons"]["calls"], stream[name]["daemons"]["calls"])
            ms = [statistics.fmean(run[name]["samples_seconds"]) * 1e3 for run in (batched, stream)]
            lines.append(f"| {transport} | {share}% | {name} | {calls[0]:.0f} | {calls[1]:.0f} | "
                         f"{_ratio(calls[1], calls[0])} | {ms[0]:.1f} | {ms[1]:.1f} | {_ratio(ms[1], ms[0])} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def _order(key: tuple[str, str, int]) -> tuple:
    transport, mode, share = key
    return transport != LOCAL, transport, share, mode != "batched"


if __name__ == "__main__":
    main()
