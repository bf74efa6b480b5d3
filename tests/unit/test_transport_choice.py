"""moerun.rig.transport.choose_transport over every combination of what was asked, where the
daemon runs, the two devices, whether a GPU parent's kernels can map the arena, and whether
device-direct failed when tried, against the rules of the design written out here:

- auto: device between GPUs of one vendor on this host, else shared on this host, else stream;
- shared or device asked for a daemon on another host: RigError; stream always works;
- device asked unless both are GPUs of one vendor: RigError;
- device-direct failing: shared under auto (with a note naming the failure), RigError when
  device was asked;
- shared: a CPU parent sends through the host; a GPU parent writes the mapped arena in place,
  or, when its kernels cannot map it, sends through the host, with a note saying so.

A device failure is only reported for a daemon that device-direct was tried on (the caller,
Rig._attach, tries device only when the first choice was device), so those are the cases here.
"""
from __future__ import annotations

import itertools

import pytest

from moerun.rig.links import RigError
from moerun.rig.transport import (
    THROUGH_DEVICE_BUFFERS,
    THROUGH_HOST,
    THROUGH_MAPPED_ARENA,
    Facts,
    choose_transport,
)

ASKED = ("auto", "device", "shared", "stream")
PARENTS = ("cpu", "cuda:0", "hip:0")
DAEMONS = ("cpu", "cuda:1", "hip:1")
FAILURE = "cudaIpcOpenMemHandle: invalid argument"
NAME = "d3 tcp://box:7070"


def expected(asked, same_host, parent, daemon, maps_arena, failure):
    """("error", words the message must hold) or (transport, parent side, words the note must
    hold or None for no note)."""
    parent_kind, daemon_kind = parent.split(":")[0], daemon.split(":")[0]
    gpus_alike = parent_kind != "cpu" and parent_kind == daemon_kind
    if asked == "stream" or (asked == "auto" and not same_host):
        return "stream", THROUGH_HOST, None
    if not same_host:
        return "error", ["another host", asked]
    if asked == "device" and not gpus_alike:
        return "error", ["GPUs of one vendor", parent_kind, daemon_kind]
    if asked == "device" and failure:
        return "error", [FAILURE]
    if gpus_alike and asked in ("auto", "device") and not failure:
        return "device", THROUGH_DEVICE_BUFFERS, None
    note = [FAILURE] if failure and first_choice_is_device(asked, same_host, parent, daemon) else []
    if parent_kind == "cpu":
        return "shared", THROUGH_HOST, note or None
    if maps_arena:
        return "shared", THROUGH_MAPPED_ARENA, note or None
    return "shared", THROUGH_HOST, note + [parent, "through the host"]


def first_choice_is_device(asked, same_host, parent, daemon):
    kind = parent.split(":")[0]
    return same_host and asked in ("auto", "device") and kind != "cpu" and daemon.split(":")[0] == kind


CASES = [(asked, same, parent, daemon, maps, failure)
         for asked, same, parent, daemon, maps, failure
         in itertools.product(ASKED, (True, False), PARENTS, DAEMONS, (True, False), (False, True))]
# A device failure where device was not the first choice (never tried) changes nothing.


def case_id(case) -> str:
    asked, same, parent, daemon, maps, failure = case
    return (f"{asked}-{'here' if same else 'remote'}-{parent}-{daemon}-{'maps' if maps else 'nomap'}"
            f"{'-devfail' if failure else ''}")


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_choice(case):
    asked, same_host, parent, daemon, maps_arena, failure = case
    facts = Facts(daemon=NAME, asked=asked, same_host=same_host, parent_device=parent, daemon_device=daemon,
                  parent_maps_arena=maps_arena)
    want = expected(*case)
    if want[0] == "error":
        with pytest.raises(RigError) as caught:
            choose_transport(facts, device_failure=FAILURE if failure else None)
        for words in [NAME, *want[1]]:
            assert words in str(caught.value)
        return
    choice = choose_transport(facts, device_failure=FAILURE if failure else None)
    transport, parent_side, note_words = want
    assert (choice.transport, choice.parent_side) == (transport, parent_side)
    if note_words is None:
        assert choice.note is None
    else:
        assert choice.note is not None
        for words in [NAME, *note_words]:
            assert words in choice.note


def test_the_table_covers_every_branch():
    """Every outcome the rules allow appears among the cases (a check on the table itself)."""
    outcomes = {expected(*case)[:2] if expected(*case)[0] != "error" else ("error",) for case in CASES}
    assert outcomes == {("stream", THROUGH_HOST), ("device", THROUGH_DEVICE_BUFFERS), ("shared", THROUGH_HOST),
                        ("shared", THROUGH_MAPPED_ARENA), ("error",)}
    assert len(CASES) == 4 * 2 * 3 * 3 * 2 * 2
