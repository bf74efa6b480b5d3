"""Threads: how a host's CPUs are split between the parent and the CPU daemons that run there
(split_cpus, with fake CPU sets), who that is for a rig (share_host), the flags and keys that
give counts, and their checks."""
from __future__ import annotations

import logging
import os

import pytest

from moerun.config import load_config_file
from moerun.rig.cores import (
    Claim,
    HostShares,
    format_cpus,
    node_cpus,
    parse_cpus,
    share_host,
    split_cpus,
)
from moerun.rig.settings import ConfigError, DaemonEntry, RigConfig
from moerun.rig.spawn import spawn_daemon


def split(host, *claims) -> dict[str, tuple[int, tuple[int, ...]]]:
    return {share.name: (share.threads, share.cpus) for share in split_cpus(host, claims)}


def disjoint_and_covering(shares: dict, host) -> bool:
    cpus = [cpu for _, owned in shares.values() for cpu in owned]
    return len(cpus) == len(set(cpus)) and set(cpus) == set(host)


# -- the split -----------------------------------------------------------------------------------

def test_a_cpu_parent_and_its_daemons_share_the_host_equally_and_disjointly():
    shares = split(range(16), Claim("parent"), Claim("d0"), Claim("d1"))
    assert shares == {"parent": (6, (0, 1, 2, 3, 4, 5)), "d0": (5, (6, 7, 8, 9, 10)), "d1": (5, (11, 12, 13, 14, 15))}
    assert disjoint_and_covering(shares, range(16))


def test_a_gpu_parent_keeps_one_core_and_the_daemons_share_the_rest():
    shares = split(range(16), Claim("parent", light=True), Claim("d0"), Claim("d1"))
    assert [shares[name][0] for name in ("parent", "d0", "d1")] == [1, 8, 7]
    assert disjoint_and_covering(shares, range(16))


def test_alone_a_gpu_parent_has_every_cpu():
    assert split(range(8), Claim("parent", light=True)) == {"parent": (8, tuple(range(8)))}


def test_given_counts_win_and_the_others_share_what_they_leave():
    shares = split(range(16), Claim("parent", 4), Claim("d0"), Claim("d1", 2))
    assert shares == {"parent": (4, (0, 1, 2, 3)), "d0": (10, tuple(range(4, 14))), "d1": (2, (14, 15))}


def test_the_host_is_the_cpus_this_process_may_use_not_a_range():
    shares = split({3, 5, 9, 11}, Claim("parent"), Claim("d0"))
    assert shares == {"parent": (2, (3, 5)), "d0": (2, (9, 11))}


def test_more_processes_than_cpus_get_one_thread_each_spread_over_the_cpus():
    shares = split(range(2), Claim("parent"), Claim("d0"), Claim("d1"))
    assert shares == {"parent": (1, (0,)), "d0": (1, (1,)), "d1": (1, (0,))}
    shares = split(range(2), Claim("parent", 2), Claim("d0"), Claim("d1"))
    assert shares == {"parent": (2, (0, 1)), "d0": (1, (0,)), "d1": (1, (1,))}


def test_a_daemon_held_to_a_numa_node_gets_that_nodes_cpus_and_the_others_the_rest():
    node1 = frozenset(range(8, 16))
    shares = split(range(16), Claim("parent"), Claim("d0", within=node1), Claim("d1"))
    assert set(shares["d0"][1]) <= node1
    assert disjoint_and_covering(shares, range(16))
    # two daemons, one per node, beside a GPU parent: each fills its node
    shares = split(range(16), Claim("parent", light=True), Claim("d0", within=frozenset(range(8))),
                   Claim("d1", within=node1))
    assert shares["d0"] == (8, tuple(range(8))) and set(shares["d1"][1]) <= node1 and shares["d1"][0] == 7
    assert disjoint_and_covering(shares, range(16))


def test_a_share_held_to_a_node_is_at_most_the_node():
    shares = split(range(16), Claim("parent", light=True), Claim("d0", within=frozenset({14, 15})))
    assert shares["d0"] == (2, (14, 15))


def test_a_node_none_of_whose_cpus_this_process_may_use_is_an_error():
    with pytest.raises(ConfigError, match=r"d0: none of its NUMA node's CPUs \(8-9\) .* \(0-3\)"):
        split_cpus(range(4), [Claim("parent"), Claim("d0", within=frozenset({8, 9}))])


def test_cpu_lists_read_and_write_as_linux_writes_them():
    assert parse_cpus("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpus({11, 10, 8, 3, 2, 1, 0}) == "0-3,8,10-11"
    assert format_cpus([5]) == "5"


def test_node_cpus_reads_the_nodes_cpulist_and_names_a_missing_one(tmp_path):
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "cpulist").write_text("8-11,24\n")
    assert node_cpus(1, tmp_path) == {8, 9, 10, 11, 24}
    with pytest.raises(ConfigError, match=f"NUMA node 2: {tmp_path}/node2/cpulist does not exist"):
        node_cpus(2, tmp_path)


# -- a rig's shares ------------------------------------------------------------------------------

def test_the_split_counts_the_cpu_daemons_of_this_host_only():
    entries = (DaemonEntry("a", device="cpu"), DaemonEntry("b", device="cuda:0"),
               DaemonEntry("c", endpoint="tcp://far:7070"), DaemonEntry("d", device="cpu", endpoint="ipc:///tmp/d.sock"),
               DaemonEntry("e", device="cpu", endpoint="tcp://far:7071", host="far-away-host"))
    config = RigConfig(daemons=tuple(entry.spec for entry in entries), daemon_entries=entries)
    shares = share_host(config, host=range(12))
    assert shares.parent.threads == 4
    assert {index: share.name for index, share in shares.daemons.items()} == {0: "a", 3: "d"}
    assert shares.spawn_settings(0) == {"threads": 4, "cpus": None}
    assert shares.spawn_settings(1) == {"threads": None, "cpus": None}


def test_flag_daemons_are_named_by_position_and_a_gpu_parent_is_light():
    shares = share_host(RigConfig(daemons=("cpu", "ipc:///tmp/x.sock", "cpu"), device="cuda:0"), host=range(9))
    assert shares.parent.threads == 1
    threads = [(index, share.name, share.threads) for index, share in shares.daemons.items()]
    assert threads == [(0, "d0", 4), (2, "d2", 4)]


def test_pinned_spawns_get_their_cpus_and_a_gpu_daemon_the_whole_host():
    entries = (DaemonEntry("a", device="cpu", threads=3), DaemonEntry("g", device="cuda:0"))
    config = RigConfig(daemons=("cpu", "cuda:0"), daemon_entries=entries, pin=True, threads=1)
    shares = share_host(config, host=range(4))
    assert shares.spawn_settings(0) == {"threads": 3, "cpus": (1, 2, 3)}
    assert shares.spawn_settings(1) == {"threads": None, "cpus": (0, 1, 2, 3)}


def test_an_overcommitted_host_is_a_warning_naming_the_counts(caplog):
    shares = share_host(RigConfig(daemons=("cpu",), threads=6), host=range(4))
    assert shares.overcommitted() == ("7 CPU threads (parent 6, d0 1) on 4 usable CPUs: the counts given (parent) "
                                      "add up to more; the processes will compete for cores (give fewer with "
                                      "--threads or `threads =`)")
    with caplog.at_level(logging.INFO, logger="moerun"):
        shares.apply_to_parent()
        shares.release()
    assert "CPU threads on this host (4 usable CPUs): parent 6, d0 1" in caplog.text
    assert "7 CPU threads" in caplog.text
    assert share_host(RigConfig(daemons=("cpu",)), host=range(4)).overcommitted() is None


def test_a_parent_pinned_in_process_is_held_to_its_cpus_until_released():
    host = sorted(os.sched_getaffinity(0))
    if len(host) < 2:
        pytest.skip("needs two CPUs")
    shares = HostShares(split_cpus(host, [Claim("parent", 1)])[0], {}, tuple(host), pin=True)
    shares.apply_to_parent()
    try:
        tasks = [int(task) for task in os.listdir("/proc/self/task")]
        assert all(os.sched_getaffinity(task) == {host[0]} for task in tasks)
    finally:
        shares.release()
    assert os.sched_getaffinity(0) == set(host)


# -- flags and keys ------------------------------------------------------------------------------

@pytest.mark.parametrize("value,message", [("0", "0 is not in the range x>=1"),
                                           ("two", "'two' is not a valid integer range")])
@pytest.mark.parametrize("command", ["run", "bench", "logits", "serve", "profile", "daemon"])
def test_threads_below_one_or_not_a_number_is_refused_by_every_command(moerun, command, value, message):
    result = moerun(command, "--threads", value)
    assert result.exit_code == 2
    assert f"Invalid value for '-t' / '--threads': {message}" in result.output


def test_numa_node_must_be_a_node_number(moerun):
    result = moerun("daemon", "--listen", "ipc:///tmp/x.sock", "--numa-node", "-1")
    assert result.exit_code == 2 and "Invalid value for '--numa-node': -1 is not in the range x>=0" in result.output


def test_config_keys_give_the_parents_and_each_daemons_threads(tmp_path):
    path = tmp_path / "rig.toml"
    path.write_text('threads = 3\npin = true\n[[daemon]]\ndevice = "cpu"\nthreads = 2\nnuma_node = 0\n')
    values = load_config_file(path)
    assert values["threads"] == 3 and values["pin"] is True
    assert values["daemon_entries"][0].threads == 2 and values["daemon_entries"][0].numa_node == 0
    assert values["daemon_entries"][0].node_flags == ("--numa-node", "0")


@pytest.mark.parametrize("text,message", [
    ("threads = 0\n", "line 1: threads = 0: must be >= 1"),
    ("threads = 2.5\n", "line 1: threads = 2.5: must be an integer"),
    ("pin = 1\n", "line 1: pin = 1: must be true or false"),
    ('[[daemon]]\ndevice = "cpu"\nthreads = 0\n', "line 3: threads = 0: must be >= 1"),
    ('[[daemon]]\ndevice = "cpu"\nnuma_node = -1\n', "line 3: numa_node = -1: must be >= 0"),
    ('[[daemon]]\nname = "g"\ndevice = "cuda:0"\nthreads = 4\n',
     'line 4: [[daemon]] g: threads is for a CPU daemon (device = "cpu")'),
    ('[[daemon]]\nname = "r"\nendpoint = "tcp://far:7070"\nnuma_node = 1\n',
     'line 4: [[daemon]] r: numa_node is for a CPU daemon (device = "cpu")'),
])
def test_bad_thread_keys_are_errors_naming_the_key_and_its_line(tmp_path, text, message):
    path = tmp_path / "rig.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config_file(path)
    assert str(error.value) == f"{path}, {message}"


def test_rig_config_refuses_threads_below_one():
    with pytest.raises(ConfigError, match="--threads must be >= 1"):
        RigConfig(threads=0)


def test_a_config_numa_node_missing_on_this_machine_stops_the_run_naming_its_path(moerun, tmp_path):
    path = tmp_path / "rig.toml"
    path.write_text('[[daemon]]\ndevice = "cpu"\nnuma_node = 4096\n')
    result = moerun("logits", "--config", path, "--ids", "1,2", "-o", tmp_path / "logits.npy")
    assert result.exit_code == 1
    assert "Error: NUMA node 4096: /sys/devices/system/node/node4096/cpulist does not exist" in result.stderr


# -- a spawned daemon's command line -------------------------------------------------------------

def test_a_spawned_cpu_daemon_gets_its_thread_count_on_its_command_line(tmp_path):
    daemon = spawn_daemon("cpu", tmp_path / "none.gguf", f"ipc://{tmp_path}/d.sock", tmp_path / "d.log", threads=3,
                          extra_args=("--numa-node", "0"))
    daemon.process.wait(60)
    arguments = daemon.process.args
    assert arguments[arguments.index("--threads") + 1] == "3"
    assert arguments[-2:] == ["--numa-node", "0"]
