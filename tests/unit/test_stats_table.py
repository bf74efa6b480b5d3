"""The --stats table: columns stay apart whatever the daemons' names and states, at any width."""
from __future__ import annotations

import pytest

from moerun.engine.report import DAEMON_COLUMNS, stats_table

RUN = {"prompt_tokens": 5, "prefill_seconds": 0.5, "prefill_tokens_per_second": 10.0, "decode_steps": 4,
       "decode_tokens": 4, "decode_seconds": 0.2, "decode_tokens_per_second": 20.0, "hot_only_layer_share": 0.25,
       "remote_pair_share": 0.5, "routed_pairs": 64, "fallback_pairs": 3}
LONG = {"name": "d0 tcp://a-very-long-host-name.rack-7.example.internal:5555", "transport": "stream",
        "calls": 123456, "mib_sent": 1.5, "mib_received": 2.25, "parent_wait_ms": 3.5, "daemon_compute_ms": 4.5,
        "fallback_calls": 7, "times_down": 1, "restarts": 0, "rejoins": 1, "state": "down: did not answer within 30 s"}
SHORT = {**LONG, "name": "d1 cpu", "transport": "shared", "calls": 9, "state": "up"}


@pytest.mark.parametrize("width", [60, 140, 250])
def test_long_endpoints_never_run_into_the_next_column(width):
    """Narrower than the table needs, it keeps its columns (the terminal wraps its lines)."""
    table = stats_table({**RUN, "daemons": [LONG, SHORT]}, width).splitlines()
    header = next(line for line in table if line.startswith("daemon"))
    headings = [heading for heading, _, _ in DAEMON_COLUMNS]
    assert header.split() == " ".join(headings).split(), "every heading whole, in order"
    assert all(len(line) <= max(width, 130) for line in table)
    short_row = next(line for line in table if line.startswith("d1 cpu"))
    # each value of the short row ends where its right-aligned heading ends (left-aligned: starts)
    for heading, value in (("calls", "9"), ("MiB sent", "1.50"), ("rejoins", "1")):
        end = header.index(heading) + len(heading)
        assert short_row[end - len(value):end] == value, (heading, short_row)
    assert short_row[header.index("transport"):].startswith("shared")
    assert "tcp://" in "".join(table), "the endpoint is shown, folded if it must be"


def test_no_daemons_no_table():
    text = stats_table({**RUN, "daemons": [], "seed": 42}, 120)
    assert "transport" not in text and text.splitlines()[-1] == "seed:    42"
