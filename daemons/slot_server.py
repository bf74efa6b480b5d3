"""A CPU expert daemon's arena served by the compiled loop (kernels/serve.c): the f32 padded
requests of the layers it holds, computed by the CPU kernels straight from the slots, with no
return to Python per request. The daemon's server (moerun.ipc.server) calls serve() in its
loop and serves whatever is left itself.
Shape legend: C batch capacity, H hidden, K experts per token.
"""
from __future__ import annotations

import ctypes

import numpy as np

from moerun.backends.cpu.library import ServeCounts, ServedLayer, SlotLayout, address
from moerun.backends.numpy_backend import QuantizedExperts
from moerun.ipc import protocol as p
from moerun.ipc import shm
from moerun.ipc.shm import Arena


class SlotServer:
    def __init__(self, arena: Arena, store: QuantizedExperts, assigned: dict[int, np.ndarray], n_layers: int):
        """assigned: the global ids of each layer's experts here (index = local id)."""
        layout = arena.layout
        x_at, _, ids_at, weights_at = layout.frame_offsets
        self.arena, self.store = arena, store             # kept: the loop reads both
        self.layout = SlotLayout(
            arena.address, layout.slots, layout.slot_bytes, shm.CONTROL_BYTES, 4 * shm.DOORBELL_WORD,
            shm.REQUEST_SEQ_OFFSET, shm.REPLY_SEQ_OFFSET, shm.PARENT_SLEEPING_OFFSET, shm.REQUEST_HEADER_OFFSET,
            shm.REPLY_HEADER_OFFSET, x_at, ids_at, weights_at, layout.batch_capacity, layout.hidden,
            layout.max_pairs_per_token, p.PROTOCOL_VERSION)
        self.maps = {layer: np.ascontiguousarray(ids, np.int64) for layer, ids in assigned.items()}
        self.layers = (ServedLayer * n_layers)()
        for layer, expert_map in self.maps.items():
            self.layers[layer] = ServedLayer(store.layers[layer], address(expert_map), len(expert_map))
        self.ids = np.empty(layout.max_pairs, np.int64)                          # [C*K] scratch
        self.out = np.empty((layout.batch_capacity, layout.hidden), np.float32)   # [C, H] scratch

    def serve(self, spin_s: float, max_s: float) -> ServeCounts:
        counts = ServeCounts()
        self.store.kernels.lib.moe_serve_slots(
            ctypes.byref(self.layout), self.layers, len(self.layers), address(self.ids), address(self.out),
            spin_s, max_s, self.store.threads, ctypes.byref(counts))
        return counts
