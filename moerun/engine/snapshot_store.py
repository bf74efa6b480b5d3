"""Prefix snapshots (a sequence's cache state at a position, and the logits after it), and
their copies on disk, so that they outlive the server: one file per snapshot under
`folder/<key>/`, the key a hash of the model file's fingerprint and the cache's layout (the
backend and its KV element type), so a snapshot is only ever offered to the model and layout
that made it. A file is written whole to a temporary name and renamed into place; it ends
with a digest of everything before it: BLAKE2b over the BLAKE2b digests of its 8 MiB blocks,
which threads hash in parallel (hashlib lets go of the GIL), so checking a file costs a
fraction of hashing it in one thread. A file read back is checked while the request that
loaded it goes on (its state restored, the rest of its prompt prefilled); nothing that request
gives out, and no snapshot taken after it, comes before the check says the file matched. A
file that is truncated, corrupt, of another format version or of another model is skipped
with a warning and deleted, never used to answer. Past
`budget` bytes the files of the lowest score — hits per hour of age per byte — go first.
Files are written by a thread of their own, off the requests' path; close() waits for them.

File: MAGIC | version u32 | header length u64 | header (JSON: key, tokens, arrays: part,
layer, dtype, shape, offset) | arrays, each 64-byte aligned | digest (32 bytes).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from moerun.backends.protocol import CacheState
from moerun.errors import UsageError

MAGIC = b"MOERUNSNAP\0\0"
VERSION = 2
PREAMBLE = struct.Struct("<12sIQ")          # magic, version, header length
DIGEST_BYTES = 32
DIGEST_BLOCK = 8 << 20
ALIGN = 64
PARTS = ("keys", "values", "conv", "ssm")

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Snapshot:
    tokens: tuple[int, ...]     # the tokens of positions 0 .. len - 1
    state: CacheState           # the cache after them
    logits: np.ndarray          # [V] f32, after the last of them
    check: Callable[[], bool] | None = None     # read from a file: whether its digest matched (waits for it)

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + self.logits.nbytes


def longest_prefix(entries: dict[tuple[int, ...], T], ids: tuple[int, ...]) -> T | None:
    """The entry whose key is the longest prefix of `ids` (all of them at most), or None."""
    keys = [key for key in entries if len(key) <= len(ids) and ids[:len(key)] == key]
    return entries[max(keys, key=len)] if keys else None


@dataclass
class StoredSnapshot:
    path: Path
    tokens: tuple[int, ...]
    nbytes: int
    hits: int = 0


class SnapshotStore:
    def __init__(self, folder: str | Path, budget: int, fingerprint: str, layout: str):
        if budget < 1:
            raise UsageError(f"the prefix cache's disk budget must be at least 1 byte (got {budget})")
        self.key = hashlib.sha256(f"{fingerprint}|{layout}|{VERSION}".encode()).hexdigest()[:32]
        self.folder = Path(folder) / self.key
        self.budget = budget
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"cannot use {folder} for prefix snapshots: {err.strerror or err}") from None
        self.files: dict[tuple[int, ...], StoredSnapshot] = {}
        for path in sorted(self.folder.glob("*.snap")):
            if (stored := self._index(path)) is not None:
                self.files[stored.tokens] = stored
        self._pending: dict[tuple[int, ...], Snapshot] = {}     # saved, not yet written
        self._lock = threading.Lock()             # files and _pending, between the requests' thread and the writer
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moerun-snapshots")

    def close(self) -> None:
        """Wait for the snapshots still being written."""
        self._writer.shutdown(wait=True)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(stored.nbytes for stored in self.files.values())

    def longest(self, ids: tuple[int, ...]) -> StoredSnapshot | Snapshot | None:
        """The longest prefix of `ids` among the files and the snapshots still waiting for
        their write (those are in memory: the answer itself)."""
        with self._lock:
            return longest_prefix({**self.files, **self._pending}, ids)

    def load(self, stored: StoredSnapshot | Snapshot) -> Snapshot | None:
        """The snapshot in `stored`'s file, or None (and the file gone) if it is truncated or its
        header does not check out. Its digest is checked while the caller goes on: the
        snapshot's check() says whether it matched (and, if not, the file is gone too)."""
        if isinstance(stored, Snapshot):
            return stored
        try:
            body, matches = read_body(stored.path)
            snapshot = self._decode(body)
        except (OSError, ValueError) as err:
            self._forget(stored, err)
            return None
        stored.hits += 1
        os.utime(stored.path)                 # its age counts from its last use

        @functools.cache
        def check() -> bool:
            if matches():
                return True
            self._forget(stored, ValueError("corrupt (its digest does not match)"))
            return False

        return dataclasses.replace(snapshot, check=check)

    def _forget(self, stored: StoredSnapshot, err: Exception) -> None:
        self._discard(stored.path, err)
        with self._lock:
            self.files.pop(stored.tokens, None)

    def save(self, snapshot: Snapshot) -> None:
        """Have `snapshot` written (a failure to write, a full disk, is a warning: the cache is only a cache)."""
        with self._lock:
            self._pending[snapshot.tokens] = snapshot
        self._writer.submit(self._write, snapshot)

    def _write(self, snapshot: Snapshot) -> None:
        try:
            self._write_file(snapshot)
        finally:
            with self._lock:
                self._pending.pop(snapshot.tokens, None)

    def _write_file(self, snapshot: Snapshot) -> None:
        name = hashlib.sha256(np.asarray(snapshot.tokens, np.int64).tobytes()).hexdigest()[:32] + ".snap"
        path, temporary = self.folder / name, self.folder / f".{name}.{os.getpid()}.tmp"
        try:
            parts = self._encode(snapshot)
            with open(temporary, "wb") as file:
                for part in parts:                 # the arrays as they are: no copy of the whole held at once
                    file.write(part)
                file.write(digest(parts))
            os.replace(temporary, path)
        except OSError as err:
            with contextlib.suppress(OSError):     # written in part, or not at all
                temporary.unlink()
            logger.warning(f"prefix snapshot of {len(snapshot.tokens)} tokens not written to {self.folder}: "
                           f"{err.strerror or err}")
            return
        with self._lock:
            self.files[snapshot.tokens] = StoredSnapshot(path, snapshot.tokens, path.stat().st_size)
            self._keep_budget(path)

    def _keep_budget(self, newest: Path) -> None:
        now = time.time()

        def score(stored: StoredSnapshot) -> float:
            try:
                age_hours = max(0.0, now - stored.path.stat().st_mtime) / 3600
            except OSError:
                return -1.0
            return (1 + stored.hits) / (1 + age_hours) / stored.nbytes

        for stored in sorted(self.files.values(), key=score):
            if sum(s.nbytes for s in self.files.values()) <= self.budget:
                break
            if stored.path != newest or len(self.files) == 1:
                stored.path.unlink(missing_ok=True)
                del self.files[stored.tokens]

    def _index(self, path: Path) -> StoredSnapshot | None:
        try:
            with open(path, "rb") as file:
                header = self._header(file.read(PREAMBLE.size), file.read)
            return StoredSnapshot(path, tuple(header["tokens"]), path.stat().st_size)
        except (OSError, ValueError, KeyError, TypeError) as err:
            self._discard(path, err)
            return None

    def _header(self, preamble: bytes, read) -> dict:
        """The JSON header after `preamble`, read(n) giving its bytes; ValueError if it is not ours."""
        if len(preamble) < PREAMBLE.size:
            raise UsageError("truncated")
        magic, version, length = PREAMBLE.unpack(preamble)
        if magic != MAGIC:
            raise UsageError("not a moerun prefix snapshot")
        if version != VERSION:
            raise UsageError(f"format version {version}, this moerun writes {VERSION}")
        header = json.loads(read(length))
        if header.get("key") != self.key:
            raise UsageError("made for another model or cache layout")
        return header

    def _encode(self, snapshot: Snapshot) -> list[memoryview]:
        """The file's body (all but its digest) as a list of buffers, the arrays' own memory
        among them: a writer thread that joined them would hold the GIL for the whole copy."""
        state, arrays, entries, offset = snapshot.state, [], [], 0
        named = [(part, layer, array) for part in PARTS for layer, array in getattr(state, part).items()]
        for part, layer, array in [*named, ("logits", -1, snapshot.logits)]:
            array = np.ascontiguousarray(array)
            entries.append({"part": part, "layer": layer, "dtype": array.dtype.str, "shape": list(array.shape),
                            "offset": offset})
            arrays += [memoryview(array.reshape(-1).view(np.uint8)), memoryview(b"\0" * (-array.nbytes % ALIGN))]
            offset += array.nbytes + (-array.nbytes % ALIGN)
        header = json.dumps({"key": self.key, "tokens": list(snapshot.tokens), "length": state.length,
                             "arrays": entries}).encode()
        head = PREAMBLE.pack(MAGIC, VERSION, len(header)) + header
        return [memoryview(head + b"\0" * (-len(head) % ALIGN)), *arrays]

    def _decode(self, body: memoryview) -> Snapshot:
        """The arrays are views of `body` (a file's bytes but its digest, which the snapshot's
        check compares; restoring a cache copies them)."""
        header = self._header(bytes(body[:PREAMBLE.size]), lambda n: bytes(body[PREAMBLE.size:PREAMBLE.size + n]))
        start = PREAMBLE.size + PREAMBLE.unpack(body[:PREAMBLE.size])[2]
        start += -start % ALIGN
        state, logits = CacheState(int(header["length"])), None
        for entry in header["arrays"]:
            dtype, shape = np.dtype(entry["dtype"]), tuple(entry["shape"])
            at = start + entry["offset"]
            array = np.frombuffer(body, dtype, int(np.prod(shape)), at).reshape(shape)
            if entry["part"] == "logits":
                logits = array
            else:
                getattr(state, entry["part"])[int(entry["layer"])] = array
        if logits is None or len(header["tokens"]) != state.length:
            raise UsageError("incomplete")
        return Snapshot(tuple(header["tokens"]), state, logits)

    def _discard(self, path: Path, err: Exception) -> None:
        logger.warning(f"prefix snapshot {path} skipped and deleted: {err}")
        path.unlink(missing_ok=True)


def digest(parts: list[memoryview]) -> bytes:
    """BLAKE2b of the BLAKE2b digests of the DIGEST_BLOCK-byte blocks of the parts laid end to
    end, hashed by parallel threads; a block across parts is hashed piece by piece (no copy,
    the GIL let go for every piece)."""
    return _combined(_hashers().map(_block_digest, _blocks(parts)))


def read_body(path: Path) -> tuple[memoryview, Callable[[], bool]]:
    """The bytes of the file at `path` but its digest, read by the hashing threads, and a call
    that says whether they match the digest: their blocks are hashed meanwhile (ValueError for
    a file cut short)."""
    with open(path, "rb") as file:
        fd = file.fileno()
        size = os.fstat(fd).st_size - DIGEST_BYTES
        if size <= PREAMBLE.size:
            raise UsageError("truncated (shorter than a header and a digest)")
        body = memoryview(np.empty(size, np.uint8))
        expected = os.pread(fd, DIGEST_BYTES, size)

        def read_block(start: int) -> None:
            block = body[start:start + DIGEST_BLOCK]
            if os.preadv(fd, [block], start) != len(block):
                raise UsageError("truncated while it was read")

        starts = range(0, size, DIGEST_BLOCK)
        list(_hashers().map(read_block, starts))
    digests = [_hashers().submit(_block_digest, [body[start:start + DIGEST_BLOCK]]) for start in starts]
    return body, lambda: _combined(digest.result() for digest in digests) == expected


def _block_digest(pieces: list[memoryview]) -> bytes:
    hasher = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for piece in pieces:
        hasher.update(piece)
    return hasher.digest()


def _combined(block_digests: Iterable[bytes]) -> bytes:
    return hashlib.blake2b(b"".join(block_digests), digest_size=DIGEST_BYTES).digest()


@functools.cache
def _hashers() -> ThreadPoolExecutor:
    """The threads that hash blocks, started once: starting them for every file cost more
    than a small file's hashing."""
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="moerun-digest")


def _blocks(parts: list[memoryview]) -> Iterator[list[memoryview]]:
    """The parts' bytes (byte views, as _encode gives them) in DIGEST_BLOCK-byte blocks (the
    last shorter), each block the views of its pieces."""
    pending, size = [], 0
    for view in parts:
        while len(view):
            piece = view[:DIGEST_BLOCK - size]
            pending.append(piece)
            size += len(piece)
            view = view[len(piece):]
            if size == DIGEST_BLOCK:
                yield pending
                pending, size = [], 0
    if pending:
        yield pending
