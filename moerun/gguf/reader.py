"""Memory-mapped GGUF reader: validated header, metadata and tensor index; zero-copy tensor views.

Layout (little-endian): magic b"GGUF", u32 version, u64 tensor count, u64 metadata count,
the metadata entries, the tensor index, then tensor data starting at the next multiple of
`general.alignment`. Tensor offsets in the index are relative to that data section.
Metadata strings decode as UTF-8 with invalid bytes replaced by U+FFFD; keys and tensor
names must be valid UTF-8.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import mmap
import operator
import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFValueType,
)

from moerun.errors import MoerunError
from moerun.gguf import quants

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4
MAX_ARRAY_NESTING = 8
FINGERPRINT_SAMPLE = 4096  # bytes of each tensor's data that go into the fingerprint
# bytes per madvise(MADV_WILLNEED): Linux reads at most the larger of the device's read-ahead
# and its largest request (128 KiB at the least) of the range one call names
WILLNEED_CHUNK = 128 << 10

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), np.dtype("u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), np.dtype("i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    GGUFValueType.BOOL: (struct.Struct("<?"), np.dtype("?")),
    GGUFValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_GGML_TYPES = {int(t): t for t in GGML_QUANT_SIZES}

# Smallest encodings, used to reject counts the rest of the file cannot possibly hold.
_MIN_VALUE_BYTES = {**{t: s.size for t, (s, _) in _SCALARS.items()}, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


class GGUFError(MoerunError):
    """A GGUF file that cannot be read, or a lookup of something it does not contain."""

    def __init__(self, path: str | os.PathLike[str], problem: str):
        super().__init__(path, problem)
        self.path = path
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: reversed GGML ne[]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class _IndexEntry(NamedTuple):
    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    relative_offset: int  # from the start of the data section


tensor_nbytes = quants.tensor_nbytes


class GGUFFile:
    """A GGUF file mapped read-only, with its metadata and tensor index parsed and validated."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._mmap: mmap.mmap | None = _map_file(self.path)
        self._data: np.ndarray | None = np.frombuffer(self._mmap, dtype=np.uint8)
        try:
            self._parse(_Parser(self.path, self._mmap, self._data))
        except BaseException:
            self.close()
            raise

    def _parse(self, parser: _Parser) -> None:
        self.version = parser.magic_and_version()
        tensor_count, kv_count = parser.counts()
        self.metadata: dict[str, Any] = parser.metadata(kv_count)
        self.alignment: int = self._alignment()
        index = parser.tensor_index(tensor_count)
        self.data_offset = _align_up(parser.pos, self.alignment)
        self.tensors: dict[str, TensorInfo] = self._tensor_infos(index)

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if type(alignment) is not int:
            raise GGUFError(self.path, f"general.alignment must be an integer, got {type(alignment).__name__}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(self.path, f"general.alignment must be a power of two, got {alignment}")
        return alignment

    def _tensor_infos(self, index: list[_IndexEntry]) -> dict[str, TensorInfo]:
        size = len(self._mmap)
        infos: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, relative_offset in index:
            if name in infos:
                raise GGUFError(self.path, f"duplicate tensor '{name}'")
            if relative_offset % self.alignment:
                raise GGUFError(
                    self.path,
                    f"tensor '{name}' offset {relative_offset} is not a multiple of the alignment {self.alignment}",
                )
            try:
                nbytes = quants.tensor_nbytes(ggml_type, shape)
            except ValueError as err:
                raise GGUFError(self.path, f"tensor '{name}' has shape {shape}: {err}") from None
            offset = self.data_offset + relative_offset
            if offset + nbytes > size:
                raise GGUFError(
                    self.path, f"tensor '{name}' ends at byte {offset + nbytes} but the file has {size} bytes"
                )
            infos[name] = TensorInfo(name, shape, ggml_type, offset, nbytes)
        self._check_no_overlap(infos.values())
        return infos

    def _check_no_overlap(self, infos: Iterable[TensorInfo]) -> None:
        ordered = sorted((info for info in infos if info.nbytes), key=lambda info: info.offset)
        for before, after in zip(ordered, ordered[1:]):
            if after.offset < before.offset + before.nbytes:
                raise GGUFError(self.path, f"tensors '{before.name}' and '{after.name}' overlap")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        try:
            return self.metadata[key]
        except KeyError:
            raise GGUFError(self.path, f"missing metadata key '{key}'") from None

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(self.path, f"missing tensor '{name}'") from None

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> np.ndarray:
        """Read-only view of the tensor's bytes in the mapping (see quants.raw_view for dtype and shape)."""
        info = self.tensor(name)
        if self._data is None:
            raise GGUFError(self.path, "file is closed")
        return quants.raw_view(self._data[info.offset : info.offset + info.nbytes], info.ggml_type, info.shape)

    def raw_expert(self, name: str, expert: int) -> np.ndarray:
        """raw(name)[expert]: a view, so other experts' pages are never read."""
        raw = self.raw(name)
        expert = operator.index(expert)
        if raw.ndim < 2 or not 0 <= expert < raw.shape[0]:
            raise IndexError(f"expert {expert} out of range for tensor '{name}' of shape {self.tensors[name].shape}")
        return raw[expert]

    def expert_ranges(self, name: str, experts: Iterable[int]) -> list[tuple[int, int]]:
        """(start, length) in the file of these experts of an expert tensor [E, ...]: one range
        per run of consecutive ids."""
        info = self.tensor(name)
        stride = info.nbytes // info.shape[0]
        ranges: list[tuple[int, int]] = []
        for expert in sorted(set(experts)):
            start = info.offset + expert * stride
            if ranges and sum(ranges[-1]) == start:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + stride)
            else:
                ranges.append((start, stride))
        return ranges

    def will_need(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Have the kernel read these (start, length) byte ranges into the page cache ahead of
        use (madvise MADV_WILLNEED; nothing where the OS has no such advice). It takes about as
        long as the reads: call it off the path that waits. The mapping stays while it runs."""
        data = self._data                  # while held, close() leaves the file mapped
        if data is None or not hasattr(mmap, "MADV_WILLNEED"):
            return
        madvise, base = _madvise(), data.ctypes.data
        for start, length in ranges:
            end = start + length
            for chunk in range(start - start % mmap.PAGESIZE, end, WILLNEED_CHUNK):
                madvise(base + chunk, min(WILLNEED_CHUNK, end - chunk), mmap.MADV_WILLNEED)

    def dequantize(self, name: str) -> np.ndarray:
        """Float32 copy of the whole tensor, of shape info.shape."""
        return self._dequantize(name, self.raw(name))

    def dequantize_expert(self, name: str, expert: int) -> np.ndarray:
        """Float32 copy of one expert, of shape info.shape[1:]."""
        return self._dequantize(name, self.raw_expert(name, expert))

    def row_table(self, name: str) -> quants.RowTable:
        """A 2-D tensor whose rows are dequantized on lookup (an embedding); checked here to
        be 2-D and of a type that can be dequantized."""
        raw = self.raw(name)
        if raw.ndim != 2:
            raise GGUFError(self.path, f"tensor '{name}' has shape {self.tensors[name].shape}; "
                                       "row lookup needs 2 dimensions")
        self._dequantize(name, raw[:1])
        return quants.RowTable(raw, self.tensors[name].ggml_type, name)

    def _dequantize(self, name: str, raw: np.ndarray) -> np.ndarray:
        ggml_type = self.tensors[name].ggml_type
        try:
            return quants.dequantize(raw, ggml_type)
        except NotImplementedError:
            problem = f"tensor '{name}' has type {ggml_type.name}, which cannot be dequantized"
            raise GGUFError(self.path, problem) from None

    def fingerprint(self) -> str:
        """Identity of the model for parent/daemon handshakes: SHA-256 over the header,
        metadata and tensor index, the file size, and the first 4 KiB of every tensor."""
        if self._data is None:
            raise GGUFError(self.path, "file is closed")
        digest = hashlib.sha256(self._data[: self.data_offset].tobytes())
        digest.update(len(self._data).to_bytes(8, "little"))
        for info in self.tensors.values():
            digest.update(self._data[info.offset : info.offset + min(info.nbytes, FINGERPRINT_SAMPLE)].tobytes())
        return digest.hexdigest()

    def close(self) -> None:
        """Drop the mapping; arrays already handed out stay valid and keep their pages until released."""
        self._data = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # views still use the mapping; it is unmapped when the last one is released
            self._mmap = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        counts = f"tensors={len(self.tensors)}, metadata={len(self.metadata)}"
        return f"GGUFFile('{self.path}', version={self.version}, {counts})"


@functools.cache
def _madvise():
    """libc's madvise through ctypes, which lets other threads run while it reads (mmap.madvise
    holds the GIL)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _align_up(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


def _map_file(path: Path) -> mmap.mmap:
    try:
        status = path.stat()
        if not stat.S_ISREG(status.st_mode):
            raise GGUFError(path, "not a regular file")
        if status.st_size == 0:
            raise GGUFError(path, "file is empty")
        with open(path, "rb") as file:
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise GGUFError(path, "file does not exist") from None
    except OSError as err:
        raise GGUFError(path, f"cannot open file: {err.strerror or err}") from None


class _Parser:
    """Bounds-checked sequential reads of the header, metadata and tensor index."""

    def __init__(self, path: Path, buffer: mmap.mmap, data: np.ndarray):
        self.path = path
        self.buffer = buffer
        self.data = data
        self.size = len(buffer)
        self.pos = 0
        self.context = "the header"

    def error(self, problem: str) -> GGUFError:
        return GGUFError(self.path, f"{self.context} {problem}")

    def truncated(self, what: str, start: int, nbytes: int) -> GGUFError:
        return GGUFError(
            self.path,
            f"file is truncated or corrupt: the {what} of {self.context} ({nbytes} bytes at byte {start}) "
            f"runs past the end of the file ({self.size} bytes)",
        )

    def take(self, nbytes: int, what: str) -> int:
        """Advance over `nbytes` bytes and return where they start."""
        start = self.pos
        if start + nbytes > self.size:
            raise self.truncated(what, start, nbytes)
        self.pos = start + nbytes
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buffer, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buffer, self.take(8, what))[0]

    def magic_and_version(self) -> int:
        head = self.buffer[:4]
        if head != MAGIC:
            if MAGIC.startswith(head):
                raise GGUFError(self.path, f"file is truncated: {self.size} bytes, shorter than the GGUF magic")
            raise GGUFError(self.path, f"not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
        self.pos = 4
        version = self.u32("version")
        if version in SUPPORTED_VERSIONS:
            return version
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version & 0xFFFF == 0 and swapped in (1, *SUPPORTED_VERSIONS):
            problem = f"big-endian GGUF files are not supported (this one is big-endian version {swapped})"
        elif version == 1:
            problem = "GGUF version 1 is not supported (it uses 32-bit counts); reconvert with a current llama.cpp"
        else:
            problem = f"unsupported GGUF version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})"
        raise GGUFError(self.path, problem)

    def counts(self) -> tuple[int, int]:
        """The header's tensor count and metadata count, checked against the bytes that follow."""
        tensor_count = self.u64("tensor count")
        kv_count = self.u64("metadata count")
        left = self.size - self.pos
        if tensor_count * _MIN_TENSOR_INFO_BYTES + kv_count * _MIN_KV_BYTES > left:
            raise GGUFError(
                self.path,
                f"file is truncated or corrupt: the header lists {tensor_count} tensors and {kv_count} "
                f"metadata entries, which cannot fit in the {left} bytes that follow",
            )
        return tensor_count, kv_count

    def name(self, what: str) -> str:
        length = self.u64(f"{what} length")
        start = self.take(length, what)
        try:
            return self.buffer[start : start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"has a {what} that is not valid UTF-8 (at byte {start})") from None

    def string(self) -> str:
        length = self.u64("string length")
        start = self.take(length, "string")
        return self.buffer[start : start + length].decode("utf-8", "replace")

    def metadata(self, count: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for i in range(count):
            self.context = f"metadata entry #{i}"
            key = self.name("key")
            self.context = f"metadata key '{key}'"
            if key in metadata:
                raise self.error("appears twice")
            metadata[key] = self.value(self.u32("value type"), nesting=0)
        return metadata

    def value(self, value_type: int, nesting: int) -> Any:
        scalar = _SCALARS.get(value_type)
        if scalar is not None:
            unpacker = scalar[0]
            return unpacker.unpack_from(self.buffer, self.take(unpacker.size, "value"))[0]
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            return self.array(nesting)
        raise self.error(f"has unknown value type {value_type}")

    def array(self, nesting: int) -> np.ndarray | list[Any]:
        """Numeric arrays as read-only views of the mapping, strings as list[str], arrays as lists."""
        if nesting >= MAX_ARRAY_NESTING:
            raise self.error(f"has arrays nested more than {MAX_ARRAY_NESTING} deep")
        element_type = self.u32("array element type")
        count = self.u64("array length")
        if element_type not in _MIN_VALUE_BYTES:
            raise self.error(f"has an array of unknown value type {element_type}")
        left = self.size - self.pos
        if count * _MIN_VALUE_BYTES[element_type] > left:
            raise GGUFError(
                self.path,
                f"file is truncated or corrupt: {self.context} has an array of {count} elements, "
                f"which cannot fit in the {left} bytes left",
            )
        scalar = _SCALARS.get(element_type)
        if scalar is not None:
            dtype = scalar[1]
            start = self.take(count * dtype.itemsize, "array")
            return self.data[start : self.pos].view(dtype)
        if element_type == GGUFValueType.STRING:
            return self.string_array(count)
        return [self.array(nesting + 1) for _ in range(count)]

    def string_array(self, count: int) -> list[str]:
        """Decode `count` length-prefixed strings in one tight loop (vocabularies hold ~150k)."""
        buffer, pos, size = self.buffer, self.pos, self.size
        unpack_length = _U64.unpack_from
        strings: list[str] = []
        append = strings.append
        try:
            for i in range(count):
                length = unpack_length(buffer, pos)[0]
                start = pos + 8
                pos = start + length
                if pos > size:
                    raise self.truncated(f"string #{i}", start, length)
                append(buffer[start:pos].decode("utf-8", "replace"))
        except struct.error:  # fewer than 8 bytes left for a length prefix
            raise self.truncated(f"length of string #{len(strings)}", pos, 8) from None
        self.pos = pos
        return strings

    def tensor_index(self, count: int) -> list[_IndexEntry]:
        index = []
        for i in range(count):
            self.context = f"tensor #{i}"
            name = self.name("name")
            self.context = f"tensor '{name}'"
            n_dims = self.u32("dimension count")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self.error(f"has {n_dims} dimensions (GGML tensors have 1 to {MAX_DIMS})")
            ne = struct.unpack_from(f"<{n_dims}Q", self.buffer, self.take(8 * n_dims, "dimension list"))
            if max(ne) >= 2**63:
                raise self.error(f"has an impossible dimension in {list(ne)}")
            raw_type = self.u32("ggml type")
            ggml_type = _GGML_TYPES.get(raw_type)
            if ggml_type is None:
                raise self.error(f"has unknown ggml type {raw_type}")
            index.append(_IndexEntry(name, ne[::-1], ggml_type, self.u64("data offset")))
        return index
