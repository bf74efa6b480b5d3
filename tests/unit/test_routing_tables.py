"""The routing tables a GPU parent keeps (moerun.rig.gpu.routing_tables), checked on the host with a
stand-in for CuPy: an expert moved into a cache slot leaves its daemon, the streamed layer and
the reads in place; given back, it returns exactly where it was."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moerun.moe.placement import PARENT, Placement
from moerun.rig.gpu.routing_tables import RoutingTables


class DeviceArray(np.ndarray):
    def set(self, values, stream=None):
        self[...] = values


class Stream:
    def record(self):
        return Done()


class Done:
    done = True


class FakeCupy:
    @staticmethod
    def asarray(values):
        return np.array(values).view(DeviceArray)


@dataclass
class FakeDevice:
    cupy: FakeCupy = FakeCupy()
    stream: Stream = Stream()

    @staticmethod
    def pinned(shape, dtype):
        return np.empty(shape, dtype)


class FakeBackend:
    device = FakeDevice()


@dataclass
class FakeHostLayer:
    index: np.ndarray


@dataclass
class FakeHost:
    layers: dict


HOMES = np.array([PARENT, PARENT, 0, 0, 1, 0], np.int16)   # experts 2, 3, 5 on CPU daemon 0; 4 on daemon 1 (a GPU)


def tables(read_in_place=None) -> RoutingTables:
    host_index = np.array([-1, -1, 0, 1, -1, 2], np.int32)
    placement = Placement({3: HOMES.copy()}, ("cpu", "cuda:1"))
    return RoutingTables(FakeBackend(), placement, [0, 1], FakeHost({3: FakeHostLayer(host_index)}), read_in_place)


def device(t: RoutingTables, name: str, key) -> list[int]:
    return np.asarray(t.on_device[name][key]).tolist()


def test_the_tables_start_from_the_placement():
    t = tables()
    assert t.parent[3].tolist() == [0, 1, -1, -1, -1, -1]
    assert t.daemon[(0, 3)].tolist() == [-1, -1, 0, 1, -1, 2]
    assert t.daemon[(1, 3)].tolist() == [-1, -1, -1, -1, 0, -1]
    assert t.streamed[3].tolist() == [-1, -1, 0, 1, -1, 2]
    assert t.reads[3].tolist() == [-1] * 6


def test_an_expert_held_in_a_slot_leaves_its_daemon_and_comes_back_the_same():
    t = tables()
    before = {name: {key: table.copy() for key, table in mirrors.items()} for name, mirrors in t._mirrors().items()}
    t.hold(3, 5, 2)                                   # expert 5 into the slot after the 2 hot experts
    t.upload()
    assert device(t, "parent", 3) == [0, 1, -1, -1, -1, 2]
    assert device(t, "daemon", (0, 3)) == [-1, -1, 0, 1, -1, -1]
    assert device(t, "streamed", 3) == [-1, -1, 0, 1, -1, -1]
    assert device(t, "daemon", (1, 3)) == [-1, -1, -1, -1, 0, -1]      # the GPU daemon's is untouched
    t.release(3, 5)
    t.upload()
    for name, mirrors in t._mirrors().items():
        for key, table in mirrors.items():
            assert table.tolist() == before[name][key].tolist()
            assert device(t, name, key) == table.tolist()


def test_an_expert_read_in_place_goes_back_to_the_reads_not_to_its_daemon():
    t = tables({3: np.array([3])})
    assert t.reads[3].tolist() == [-1, -1, -1, 1, -1, -1]
    assert t.daemon[(0, 3)].tolist() == [-1, -1, 0, -1, -1, 2]
    t.hold(3, 3, 2)
    assert t.reads[3][3] == -1 and t.daemon[(0, 3)][3] == -1 and t.parent[3][3] == 2
    t.release(3, 3)
    assert t.reads[3].tolist() == [-1, -1, -1, 1, -1, -1]
    assert t.daemon[(0, 3)].tolist() == [-1, -1, 0, -1, -1, 2]
    assert t.streamed[3][3] == 1
