"""The timing loop the benchmark scripts share: wall seconds of repeated calls of one function,
after untimed warm-up calls, for at least a number of calls and a time budget.

    from timing import call_seconds          # a script in scripts/ runs with scripts/ on sys.path
    seconds = min(call_seconds(lambda: product(x), runs=3))
"""
from __future__ import annotations

import time
from collections.abc import Callable


def call_seconds(call: Callable[[], object], runs: int, warmup: int = 1, budget_s: float = 0.0) -> list[float]:
    """Wall seconds of each call of call(): `warmup` untimed calls first, then at least `runs`
    timed ones, and more until `budget_s` seconds have gone by since the first timed one."""
    for _ in range(warmup):
        call()
    seconds: list[float] = []
    started = time.perf_counter()
    while len(seconds) < runs or time.perf_counter() - started < budget_s:
        begin = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - begin)
    return seconds
