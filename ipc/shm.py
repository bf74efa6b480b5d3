"""The shared-memory arena of the `shared` transport: a POSIX shm file the parent creates, the
daemon maps, and the parent unlinks as soon as the daemon has it mapped.

Layout (all integers little-endian; docs/protocol.md has the full table):

    control block, CONTROL_BYTES:  static fields at 0, then one 32-bit word per cache line:
                                   state, control bell, doorbell, daemon-sleeping
    slot i at CONTROL_BYTES + i * slot_bytes:
        +0    request_seq       +64   reply_seq       +128  parent-sleeping
        +256  request header (u32 length, msgpack)    +2048 reply header (u32 length, msgpack)
        +4096 data: request frames, then the reply frame (sized for f32 payloads)

Shape legend: T tokens (batch capacity C), H hidden size, K max experts per token.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import re
import secrets
import stat
import struct
from dataclasses import dataclass

from moerun.ipc.doorbell import Doorbell, FutexUnavailable, require_futex
from moerun.ipc.protocol import BAD_FRAME, BAD_REQUEST, ProtocolError, int_field

SHM_DIR = "/dev/shm"
NAME_PREFIX = "moerun-"
NAME_PATTERN = re.compile(r"moerun-([0-9]+)-[0-9a-f]{16}")
MAGIC = 0x41454F4D  # b"MOEA"
LAYOUT_VERSION = 1
MAX_SLOTS = 64
MAX_FRAMES = 8

CONTROL_BYTES = 4096
STATIC_FORMAT = "<IIIIQIII"  # magic, layout, slots, batch_capacity, slot_bytes, hidden, K, pid
STATE_WORD, CONTROL_BELL_WORD, DOORBELL_WORD, DAEMON_SLEEPING_WORD = 16, 32, 48, 64
STATE_CREATED, STATE_ATTACHED, STATE_DETACHED = 0, 1, 2

REQUEST_SEQ_OFFSET, REPLY_SEQ_OFFSET, PARENT_SLEEPING_OFFSET = 0, 64, 128
REQUEST_HEADER_OFFSET, REPLY_HEADER_OFFSET, DATA_OFFSET = 256, 2048, 4096
FRAME_ALIGN = 64


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class ArenaLayout:
    slots: int
    batch_capacity: int       # C, tokens per request
    hidden: int               # H
    max_pairs_per_token: int  # K

    @property
    def slot_bytes(self) -> int:
        c, h, k = self.batch_capacity, self.hidden, self.max_pairs_per_token
        data = (_align(c * h * 4, FRAME_ALIGN) + _align(c * 4, FRAME_ALIGN)
                + 2 * _align(c * k * 4, FRAME_ALIGN))
        return _align(DATA_OFFSET + data, mmap.PAGESIZE)

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


def request_frame_offsets(sizes) -> list[list[int]]:
    """[offset, nbytes] of each request frame, packed from the slot's data area."""
    offsets, at = [], DATA_OFFSET
    for size in sizes:
        offsets.append([at, size])
        at = _align(at + size, FRAME_ALIGN)
    return offsets


class Slot:
    """One request/reply slot: its sequence doorbells, header areas and data area."""

    def __init__(self, buffer: memoryview, words: memoryview, base_address: int, offset: int,
                 size: int):
        self.size = size
        self.buffer = buffer[offset:offset + size]
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

    def write_request_header(self, header: bytes) -> None:
        self._write_header(REQUEST_HEADER_OFFSET, REPLY_HEADER_OFFSET, header)

    def write_reply_header(self, header: bytes) -> None:
        self._write_header(REPLY_HEADER_OFFSET, DATA_OFFSET, header)

    def request_header(self) -> memoryview:
        return self._read_header(REQUEST_HEADER_OFFSET, REPLY_HEADER_OFFSET)

    def reply_header(self) -> memoryview:
        return self._read_header(REPLY_HEADER_OFFSET, DATA_OFFSET)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Bytes [offset, offset + nbytes) of the slot, which must lie in its data area."""
        try:
            if DATA_OFFSET <= offset and 0 <= nbytes and offset + nbytes <= self.size:
                return self.buffer[offset:offset + nbytes]
        except TypeError:
            pass
        raise ProtocolError(BAD_FRAME, f"frame [{offset!r}, +{nbytes!r}) is outside the "
                                       f"slot's data area [{DATA_OFFSET}, {self.size})")

    def frames(self, table) -> list[memoryview]:
        """Views of the frames a header lists as [[offset, nbytes], ...]."""
        if type(table) is not list or len(table) > MAX_FRAMES:
            raise ProtocolError(BAD_FRAME, "slot message needs frames [[offset, nbytes], ...]")
        try:
            return [self.view(offset, nbytes) for offset, nbytes in table]
        except (TypeError, ValueError):
            raise ProtocolError(BAD_FRAME, f"bad frame table {table!r}") from None

    def _write_header(self, start: int, end: int, header: bytes) -> None:
        if 4 + len(header) > end - start:
            raise ProtocolError(BAD_REQUEST, f"header of {len(header)} bytes does not fit a slot")
        self._words[self._word + start // 4] = len(header)
        self.buffer[start + 4:start + 4 + len(header)] = header

    def _read_header(self, start: int, end: int) -> memoryview:
        length = self._words[self._word + start // 4]
        if length > end - start - 4:
            raise ProtocolError(BAD_FRAME, f"slot header length {length} exceeds its area")
        return self.buffer[start + 4:start + 4 + length]


class Arena:
    """A mapped arena; `create` on the parent side, `attach` on the daemon side."""

    def __init__(self, name: str, mm: mmap.mmap, layout: ArenaLayout):
        self.name, self.layout, self._mm = name, layout, mm
        anchor = ctypes.c_char.from_buffer(mm)
        base_address = ctypes.addressof(anchor)
        del anchor  # an exported buffer would keep the mapping from closing
        self.buffer = memoryview(mm)
        self.words = self.buffer.cast("I")
        self.doorbell = Doorbell(self.words, base_address, DOORBELL_WORD, DAEMON_SLEEPING_WORD)
        self.slots = [Slot(self.buffer, self.words, base_address,
                           CONTROL_BYTES + i * layout.slot_bytes, layout.slot_bytes)
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
        views = [slot.buffer for slot in self.slots] + [self.words, self.buffer]
        self.slots = []
        try:
            for view in views:
                view.release()
            self._mm.close()
        except BufferError:
            pass


def sweep_stale_segments() -> list[str]:
    """Remove /dev/shm/moerun-<pid>-* left by parents that no longer run; returns the names."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        match = NAME_PATTERN.fullmatch(name)
        if match and not _pid_alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
