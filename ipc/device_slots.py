"""The device-direct transport's buffers: one device allocation of a GPU daemon, exported
to the parent through CUDA IPC at ATTACH, holding per arena slot the request the parent
writes (x in the payload dtype, ids and weights padded to K per token) and the f32 reply
the daemon writes. Both sides derive the offsets from the arena layout.

Shape legend: C batch capacity (tokens), H hidden size, K experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass

from moerun.ipc.shm import ArenaLayout, align_up

ALIGN = 256


@dataclass(frozen=True)
class SlotBuffers:
    x: int              # offsets in the allocation: x [C, H] (sized for f32)
    ids: int            # [C, K] int32, -1: no expert
    weights: int        # [C, K] f32
    reply: int          # [C, H] f32


@dataclass(frozen=True)
class DeviceSlots:
    layout: ArenaLayout

    @property
    def rows_bytes(self) -> int:
        """One [C, H] f32 buffer, aligned."""
        return align_up(self.layout.batch_capacity * self.layout.hidden * 4, ALIGN)

    @property
    def pairs_bytes(self) -> int:
        """One [C, K] buffer of 4-byte items, aligned."""
        return align_up(self.layout.max_pairs * 4, ALIGN)

    @property
    def slot_bytes(self) -> int:
        return 2 * self.rows_bytes + 2 * self.pairs_bytes

    @property
    def size(self) -> int:
        return self.layout.slots * self.slot_bytes

    def buffers(self, index: int) -> SlotBuffers:
        base, rows, pairs = index * self.slot_bytes, self.rows_bytes, self.pairs_bytes
        return SlotBuffers(x=base, ids=base + rows, weights=base + rows + pairs, reply=base + rows + 2 * pairs)
