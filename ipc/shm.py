"""The shared-memory arena of the `shared` transport: a POSIX shm file the parent creates, the
daemon maps, and the parent unlinks as soon as the daemon has it mapped.

Layout (all integers little-endian; docs/protocol.md has the full table):

    control block, CONTROL_BYTES:  static fields at 0, then one 32-bit word per cache line:
                                   state, control bell, doorbell, daemon-sleeping
    slot i at CONTROL_BYTES + i * slot_bytes:
        +0    request_seq       +64   reply_seq       +128  parent-sleeping
        +256  request header    +2048 reply header    (binary structs, below)
        +4096 frames, each at a fixed offset sized for the capacity and f32 payloads:
              x [C, H], counts [C], local_ids [C*K], weights [C*K]; the result [C, H] at +4096

Shape legend: T tokens (batch capacity C), H hidden size, K max experts per token.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import re
import secrets
import stat
import struct
from dataclasses import dataclass

import numpy as np

from moerun.ipc import protocol as p
from moerun.ipc.doorbell import Doorbell, FutexUnavailable, require_futex
from moerun.ipc.processes import pid_alive
from moerun.ipc.protocol import BAD_REQUEST, ProtocolError, int_field

SHM_DIR = "/dev/shm"
NAME_PREFIX = "moerun-"
NAME_PATTERN = re.compile(r"moerun-([0-9]+)-[0-9a-f]{16}")
CUDA_EVENT_FILE = re.compile(r"cuda\.shm\.[0-9]+\.([0-9a-f]+)\.[0-9]+")
MAGIC = 0x41454F4D  # b"MOEA"
LAYOUT_VERSION = 2
MAX_SLOTS = 64

CONTROL_BYTES = 4096
STATIC_FORMAT = "<IIIIQIII"  # magic, layout, slots, batch_capacity, slot_bytes, hidden, K, pid
STATE_WORD, CONTROL_BELL_WORD, DOORBELL_WORD, DAEMON_SLEEPING_WORD = 16, 32, 48, 64
STATE_CREATED, STATE_ATTACHED, STATE_DETACHED = 0, 1, 2

REQUEST_SEQ_OFFSET, REPLY_SEQ_OFFSET, PARENT_SLEEPING_OFFSET = 0, 64, 128
REQUEST_HEADER_OFFSET, REPLY_HEADER_OFFSET, DATA_OFFSET = 256, 2048, 4096
FRAME_ALIGN = 64


def align_up(n: int, to: int) -> int:
    """n rounded up to a multiple of `to`."""
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class ArenaLayout:
    slots: int
    batch_capacity: int       # C, tokens per request
    hidden: int               # H
    max_pairs_per_token: int  # K

    @property
    def max_pairs(self) -> int:
        return self.batch_capacity * self.max_pairs_per_token

    @property
    def frame_offsets(self) -> tuple[int, int, int, int]:
        """Slot offsets of the x, counts, local_ids and weights frames."""
        x = DATA_OFFSET
        counts = x + align_up(self.batch_capacity * self.hidden * 4, FRAME_ALIGN)
        local_ids = counts + align_up(self.batch_capacity * 4, FRAME_ALIGN)
        weights = local_ids + align_up(self.max_pairs * 4, FRAME_ALIGN)
        return x, counts, local_ids, weights

    @property
    def slot_bytes(self) -> int:
        return align_up(self.frame_offsets[3] + self.max_pairs * 4, mmap.PAGESIZE)

    @property
    def size(self) -> int:
        return CONTROL_BYTES + self.slots * self.slot_bytes

    def fields(self) -> dict:
        """The layout as ATTACH header fields."""
        return {"layout": LAYOUT_VERSION, "size": self.size, "slots": self.slots,
                "slot_bytes": self.slot_bytes, "batch_capacity": self.batch_capacity,
                "hidden": self.hidden, "max_pairs_per_token": self.max_pairs_per_token,
                "control_bytes": CONTROL_BYTES, "data_offset": DATA_OFFSET}

    @classmethod
    def from_fields(cls, header: dict, *, hidden: int, batch_capacity_max: int) -> ArenaLayout:
        """Validate an ATTACH header against this daemon; raises ProtocolError(bad_request)."""
        int_field(header, "layout", LAYOUT_VERSION, LAYOUT_VERSION)
        layout = cls(slots=int_field(header, "slots", 1, MAX_SLOTS),
                     batch_capacity=int_field(header, "batch_capacity", 1, batch_capacity_max),
                     hidden=int_field(header, "hidden", hidden, hidden),
                     max_pairs_per_token=int_field(header, "max_pairs_per_token", 1, 1024))
        for name, value in (("size", layout.size), ("slot_bytes", layout.slot_bytes),
                            ("control_bytes", CONTROL_BYTES), ("data_offset", DATA_OFFSET)):
            int_field(header, name, value, value)
        return layout


# -- the binary headers inside a slot (docs/protocol.md §5) ------------------------------------
# A COMPUTE request at REQUEST_HEADER_OFFSET and its RESULT or ERROR reply at REPLY_HEADER_OFFSET,
# each a fixed little-endian struct read or written in one call. The frames sit at fixed places
# in the slot, so the headers carry no frame table. Control messages stay msgpack over ZeroMQ.

OP_COMPUTE, OP_RESULT, OP_ERROR, OP_COMPUTE_PADDED, OP_FORWARD = 1, 2, 3, 4, 5
COMPUTE_OPS = (OP_COMPUTE, OP_COMPUTE_PADDED)
DTYPES = tuple(p.DTYPE_CODES)                   # a payload dtype's code is its position
ERROR_CODES = (p.BAD_FRAME, p.VERSION_MISMATCH, p.FINGERPRINT_MISMATCH, p.BUSY, p.NO_SESSION,
               p.BAD_REQUEST, p.NOT_READY, p.INTERNAL)   # an error code's number: position + 1
ERROR_NUMBERS = {code: number for number, code in enumerate(ERROR_CODES, start=1)}

# version, op, request id, layer, dtype code, tokens T, pairs P, hidden H
REQUEST = struct.Struct("<IIQiIIII")
# version, op, request id, layer, tokens T, hidden H, error number, compute_us, message bytes
REPLY = struct.Struct("<IIQiIIIdI")
# a layer shard's FORWARD: version, op, request id, sequence, start, dtype code, tokens T, hidden H
FORWARD_REQUEST = struct.Struct("<IIQQQIII")
REQUEST_ID = struct.Struct("<Q")
REQUEST_OP = struct.Struct("<I")
REQUEST_ID_OFFSET = REQUEST_HEADER_OFFSET + 8
MESSAGE_OFFSET = REPLY_HEADER_OFFSET + REPLY.size
MAX_MESSAGE_BYTES = 4 * p.MAX_ERROR_MESSAGE      # UTF-8 of MAX_ERROR_MESSAGE characters


def write_request_header(slot_buffer, request_id: int, layer: int, dtype: str, tokens: int,
                  pairs: int, hidden: int, padded: bool = False) -> None:
    """A ragged request (counts [T], local_ids and weights [P]) or a padded one (ids and
    weights [T, K], -1: no expert; P = T * K), which a GPU parent writes from the device."""
    op = OP_COMPUTE_PADDED if padded else OP_COMPUTE
    REQUEST.pack_into(slot_buffer, REQUEST_HEADER_OFFSET, p.PROTOCOL_VERSION, op,
                      request_id, layer, p.DTYPE_CODES[dtype], tokens, pairs, hidden)


def request_id(slot_buffer) -> int:
    """The request id, readable whatever else the header holds (every reply echoes it)."""
    return REQUEST_ID.unpack_from(slot_buffer, REQUEST_ID_OFFSET)[0]


def request_op(slot_buffer) -> int:
    """The op of the request in a slot: a compute (1, 4) or a layer shard's FORWARD (5)."""
    return REQUEST_OP.unpack_from(slot_buffer, REQUEST_HEADER_OFFSET + 4)[0]


def write_forward_header(slot_buffer, request_id: int, sequence: int, start: int, dtype: str, tokens: int,
                         hidden: int) -> None:
    """A FORWARD request: x [T, H] in `dtype` in the x frame, at positions start.. of `sequence`."""
    FORWARD_REQUEST.pack_into(slot_buffer, REQUEST_HEADER_OFFSET, p.PROTOCOL_VERSION, OP_FORWARD, request_id,
                              sequence, start, p.DTYPE_CODES[dtype], tokens, hidden)


def read_forward_header(slot_buffer, layout: ArenaLayout) -> tuple[int, int, str, int]:
    """(sequence, start, dtype, T) of the FORWARD header in a slot, checked against the arena;
    raises ProtocolError (version_mismatch, bad_request)."""
    version, _, _, sequence, start, dtype, tokens, hidden = FORWARD_REQUEST.unpack_from(
        slot_buffer, REQUEST_HEADER_OFFSET)
    if version != p.PROTOCOL_VERSION:
        raise p.version_mismatch(version, "parent", "daemon")
    if dtype >= len(DTYPES) or hidden != layout.hidden or not 1 <= tokens <= layout.batch_capacity:
        raise ProtocolError(p.BAD_REQUEST, f"forward with dtype code {dtype}, {tokens} tokens and hidden {hidden}: "
                                           f"expected a dtype code below {len(DTYPES)}, 1..{layout.batch_capacity} "
                                           f"tokens and hidden {layout.hidden}")
    return sequence, start, DTYPES[dtype], tokens


def read_request_header(slot_buffer, layout: ArenaLayout) -> tuple[int, str, int, int, bool]:
    """(layer, dtype, T, P, padded) of the COMPUTE header in a slot, checked against the
    arena's capacity; raises ProtocolError (version_mismatch, bad_request)."""
    version, op, _, layer, dtype, tokens, pairs, hidden = REQUEST.unpack_from(
        slot_buffer, REQUEST_HEADER_OFFSET)
    if version != p.PROTOCOL_VERSION:
        raise p.version_mismatch(version, "parent", "daemon")
    padded = op == OP_COMPUTE_PADDED
    if (op not in COMPUTE_OPS or layer < 0 or dtype >= len(DTYPES) or hidden != layout.hidden
            or not 1 <= tokens <= layout.batch_capacity or pairs > layout.max_pairs
            or (padded and pairs != tokens * layout.max_pairs_per_token)):
        raise ProtocolError(p.BAD_REQUEST, _first_bad_field(op, layer, dtype, tokens, pairs,
                                                            hidden, layout))
    return layer, DTYPES[dtype], tokens, pairs, padded


def write_result_header(slot_buffer, request_id: int, layer: int, tokens: int, hidden: int,
                 compute_us: float) -> None:
    REPLY.pack_into(slot_buffer, REPLY_HEADER_OFFSET, p.PROTOCOL_VERSION, OP_RESULT, request_id,
                    layer, tokens, hidden, 0, compute_us, 0)


def write_error_header(slot_buffer, request_id: int, code: str, message: str) -> None:
    text = message[:p.MAX_ERROR_MESSAGE].encode("utf-8", "replace")
    REPLY.pack_into(slot_buffer, REPLY_HEADER_OFFSET, p.PROTOCOL_VERSION, OP_ERROR, request_id,
                    0, 0, 0, ERROR_NUMBERS[code], 0.0, len(text))
    slot_buffer[MESSAGE_OFFSET:MESSAGE_OFFSET + len(text)] = text


def read_reply_header(slot_buffer) -> tuple[int, int, int, float, tuple[str, str] | None]:
    """(request id, T, H, compute_us, error) of the reply in a slot; error is None for a RESULT
    and (code, message) for an ERROR. Raises ProtocolError when the reply is unreadable."""
    version, op, reply_id, _, tokens, hidden, error, compute_us, length = REPLY.unpack_from(
        slot_buffer, REPLY_HEADER_OFFSET)
    if version != p.PROTOCOL_VERSION:
        raise p.version_mismatch(version, "daemon", "parent")
    if op == OP_RESULT:
        return reply_id, tokens, hidden, compute_us, None
    if op != OP_ERROR or not 1 <= error <= len(ERROR_CODES) or length > MAX_MESSAGE_BYTES:
        raise ProtocolError(p.BAD_FRAME, f"slot reply with op {op}, error number {error} and "
                                         f"a message of {length} bytes")
    message = bytes(slot_buffer[MESSAGE_OFFSET:MESSAGE_OFFSET + length])
    return reply_id, 0, 0, 0.0, (ERROR_CODES[error - 1], message.decode("utf-8", "replace"))


def _first_bad_field(op: int, layer: int, dtype: int, tokens: int, pairs: int, hidden: int,
                     layout: ArenaLayout) -> str:
    if op not in COMPUTE_OPS:
        return f"only compute (ops {OP_COMPUTE} and {OP_COMPUTE_PADDED}) uses a slot, got op {op}"
    if dtype >= len(DTYPES):
        return (f"unknown payload dtype code {dtype} (known: "
                f"{', '.join(f'{code} {name}' for code, name in enumerate(DTYPES))})")
    for name, value, low, high in (("layer", layer, 0, 2**31 - 1),
                                   ("tokens", tokens, 1, layout.batch_capacity),
                                   ("pairs", pairs, 0, layout.max_pairs)):
        if not low <= value <= high:
            return f"field {name!r} must be in [{low}, {high}], got {value}"
    if hidden != layout.hidden:
        return f"field 'hidden' must be {layout.hidden}, got {hidden}"
    return (f"a padded request carries tokens * {layout.max_pairs_per_token} pairs "
            f"({tokens * layout.max_pairs_per_token}), got {pairs}")


class Slot:
    """One request/reply slot: its sequence doorbells, its header areas (`buffer`, the slot's
    bytes), and numpy views of its frames at full capacity, which requests slice."""

    def __init__(self, buffer: memoryview, words: memoryview, base_address: int, offset: int,
                 layout: ArenaLayout):
        self.buffer = buffer[offset:offset + layout.slot_bytes]
        self.address = base_address + offset     # where the slot is mapped in this process
        self._layout = layout
        rows = (layout.batch_capacity, layout.hidden)
        x_at, counts_at, local_ids_at, weights_at = layout.frame_offsets
        self._x_at = x_at
        self._x: dict[str, np.ndarray] = {}     # [C, H] by payload dtype, made on first use
        self._counts = self._view(np.int32, (layout.batch_capacity,), counts_at)
        self._local_ids = self._view(np.int32, (layout.max_pairs,), local_ids_at)
        self._weights = self._view(np.float32, (layout.max_pairs,), weights_at)
        self._result = self._view(np.float32, rows, DATA_OFFSET)
        self._words, self._word = words, offset // 4
        self._request_word = self._word + REQUEST_SEQ_OFFSET // 4
        self._reply_word = self._word + REPLY_SEQ_OFFSET // 4
        self.reply = Doorbell(words, base_address, self._reply_word,
                              self._word + PARENT_SLEEPING_OFFSET // 4)

    @property
    def request_seq(self) -> int:
        return self._words[self._request_word]

    @request_seq.setter
    def request_seq(self, value: int) -> None:
        self._words[self._request_word] = value & 0xFFFFFFFF

    def pending(self) -> bool:
        """The parent wrote a request the daemon has not answered yet."""
        return self._words[self._request_word] != self._words[self._reply_word]

    def write_request_frames(self, dtype: str, x: np.ndarray, counts: np.ndarray,
                             local_ids: np.ndarray, weights: np.ndarray) -> None:
        """Parent side: x [T, H] (encoded as `dtype` on the way in), counts [T], local_ids and
        weights [P]; the caller checked them against the capacity."""
        self._x_view(dtype)[:len(x)] = x
        self._counts[:len(counts)] = counts
        self._local_ids[:len(local_ids)] = local_ids
        self._weights[:len(weights)] = weights

    def request_frames(self, dtype: str, tokens: int, pairs: int) -> tuple:
        """Daemon side: x f32 [T, H] (a view for f32 payloads), counts [T], local_ids [P] and
        weights [P], as views of the slot."""
        x = self._x_view(dtype)[:tokens]
        return (x if dtype == "f32" else x.astype(np.float32), self._counts[:tokens],
                self._local_ids[:pairs], self._weights[:pairs])

    def write_x(self, dtype: str, x: np.ndarray) -> None:
        """Parent side: x [T, H] alone (a layer shard's FORWARD), encoded as `dtype`."""
        self._x_view(dtype)[:len(x)] = x

    def write_result(self, out: np.ndarray) -> None:
        """Daemon side: the f32 [T, H] result, at DATA_OFFSET."""
        self._result[:len(out)] = out

    def read_result(self, tokens: int) -> np.ndarray:
        """Parent side: a copy of the f32 [T, H] result."""
        return self._result[:tokens].copy()

    def frame_addresses(self) -> tuple[int, int, int]:
        """Addresses of the x, local_ids and weights frames in this process (the result
        lands at the x frame's address): for copies and kernels that reach the slot directly."""
        x_at, _, local_ids_at, weights_at = self._layout.frame_offsets
        return self.address + x_at, self.address + local_ids_at, self.address + weights_at

    def _x_view(self, dtype: str) -> np.ndarray:
        """The slot's x frame [C, H] as values of payload dtype `dtype`."""
        if dtype not in self._x:
            self._x[dtype] = self._view(p.value_dtype(dtype), (self._layout.batch_capacity, self._layout.hidden),
                                        self._x_at)
        return self._x[dtype]

    def _view(self, dtype, shape: tuple[int, ...], offset: int) -> np.ndarray:
        return np.frombuffer(self.buffer, dtype, math.prod(shape), offset).reshape(shape)


class Arena:
    """A mapped arena; `create` on the parent side, `attach` on the daemon side."""

    def __init__(self, name: str, mm: mmap.mmap, layout: ArenaLayout):
        self.name, self.layout, self._mm = name, layout, mm
        anchor = ctypes.c_char.from_buffer(mm)
        self.address = base_address = ctypes.addressof(anchor)
        del anchor  # an exported buffer would keep the mapping from closing
        self.before_close: list = []   # callables run before unmapping (a GPU unregisters the pages)
        self.buffer = memoryview(mm)
        self.words = self.buffer.cast("I")
        self.doorbell = Doorbell(self.words, base_address, DOORBELL_WORD, DAEMON_SLEEPING_WORD)
        self.slots = [Slot(self.buffer, self.words, base_address,
                           CONTROL_BYTES + i * layout.slot_bytes, layout)
                      for i in range(layout.slots)]

    @classmethod
    def create(cls, layout: ArenaLayout) -> Arena:
        require_futex()
        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(os.path.join(SHM_DIR, name), flags, 0o600)
        try:
            os.ftruncate(fd, layout.size)
            mm = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(os.path.join(SHM_DIR, name))
            raise
        finally:
            os.close(fd)
        struct.pack_into(STATIC_FORMAT, mm, 0, MAGIC, LAYOUT_VERSION, layout.slots,
                         layout.batch_capacity, layout.slot_bytes, layout.hidden,
                         layout.max_pairs_per_token, os.getpid())
        return cls(name, mm, layout)

    @classmethod
    def attach(cls, name, layout: ArenaLayout) -> Arena:
        """Map an arena named in an ATTACH request; raises ProtocolError(bad_request)."""
        try:
            require_futex()
        except FutexUnavailable as e:
            raise ProtocolError(BAD_REQUEST, str(e)) from None
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise ProtocolError(BAD_REQUEST, f"bad arena name {name!r}")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ProtocolError(BAD_REQUEST, f"cannot open {path}: {e.strerror} (the shared "
                                             f"transport needs the same host)") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != layout.size:
                raise ProtocolError(BAD_REQUEST, f"{path} has {st.st_size} bytes, "
                                                 f"the layout needs {layout.size}")
            mm = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        static = struct.unpack_from(STATIC_FORMAT, mm, 0)[:7]
        expected = (MAGIC, LAYOUT_VERSION, layout.slots, layout.batch_capacity, layout.slot_bytes,
                    layout.hidden, layout.max_pairs_per_token)
        if static != expected:
            mm.close()
            raise ProtocolError(BAD_REQUEST, f"{path}: control block {static} does not match "
                                             f"the ATTACH request {expected}")
        return cls(name, mm, layout)

    @property
    def state(self) -> int:
        return self.words[STATE_WORD]

    @state.setter
    def state(self, value: int) -> None:
        self.words[STATE_WORD] = value

    def any_pending(self) -> bool:
        """Some slot holds a request the daemon has not answered."""
        return any(slot.pending() for slot in self.slots)

    def rouse(self) -> None:
        """Parent side: ring the doorbell if the daemon sleeps while a slot holds a request
        (one a GPU wrote, which cannot wake it)."""
        if self.words[DAEMON_SLEEPING_WORD] and self.any_pending():
            self.doorbell.ring()

    @property
    def control_bell(self) -> int:
        return self.words[CONTROL_BELL_WORD]

    def announce_control_message(self) -> None:
        """Parent side: a control message is on its way over ZeroMQ; wake the daemon for it."""
        self.words[CONTROL_BELL_WORD] = (self.words[CONTROL_BELL_WORD] + 1) & 0xFFFFFFFF
        self.doorbell.ring()

    def detach(self) -> None:
        """Daemon side: mark the arena abandoned, wake the parent's waiters, unmap."""
        self.state = STATE_DETACHED
        for slot in self.slots:
            slot.reply.wake()
        self.close()

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap. A view still held elsewhere keeps the mapping alive until it is collected."""
        while self.before_close:
            self.before_close.pop()()
        views = [slot.buffer for slot in self.slots] + [self.words, self.buffer]
        self.slots = []  # frees the slots' numpy views, which pin their buffers
        try:
            for view in views:
                view.release()
            self._mm.close()
        except BufferError:
            pass


def sweep_stale_segments() -> list[str]:
    """Remove /dev/shm/moerun-<pid>-* left by parents that no longer run, and the files the
    CUDA driver backs a process's IPC events with (cuda.shm.<n>.<pid in hex>.<n>, which it
    leaves behind when that process ends) of this user's processes that no longer run;
    returns the names."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if _stale(name):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _stale(name: str) -> bool:
    match = NAME_PATTERN.fullmatch(name)
    if match:
        return not pid_alive(int(match.group(1)))
    match = CUDA_EVENT_FILE.fullmatch(name)
    return bool(match) and _owned(name) and not pid_alive(int(match.group(1), 16))


def _owned(name: str) -> bool:
    try:
        return os.stat(os.path.join(SHM_DIR, name)).st_uid == os.getuid()
    except OSError:
        return False
