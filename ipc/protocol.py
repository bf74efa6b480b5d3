"""The parent/daemon wire protocol: message headers, ops, error codes and payload encodings.

Every message is one msgpack header (a map with at least "v" and "op") followed by zero or
more raw data frames. No pickle anywhere; docs/protocol.md is the full reference.

Shape legend: T tokens, H hidden size, P routed (token, expert) pairs sent to one daemon.
"""
from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass

import msgpack
import numpy as np

from moerun.errors import MoerunError

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
MAX_ERROR_MESSAGE = 400  # characters; an error reply must fit a shared-memory slot header
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

# Ops.
HELLO = "hello"
ASSIGN = "assign"
PROGRESS = "progress"
READY = "ready"
ATTACH = "attach"
COMPUTE = "compute"
RESULT = "result"
STATS = "stats"
PING = "ping"
PONG = "pong"
BYE = "bye"
SHUTDOWN = "shutdown"
ERROR = "error"
FORWARD = "forward"       # a layer shard: the hidden state through its layers
HIDDEN = "hidden"         # its reply
OPS = (HELLO, ASSIGN, PROGRESS, READY, ATTACH, COMPUTE, RESULT, STATS, PING, PONG, BYE, SHUTDOWN,
       ERROR, FORWARD, HIDDEN)

# Error codes of {"op": "error"} replies.
BAD_FRAME = "bad_frame"
VERSION_MISMATCH = "version_mismatch"
FINGERPRINT_MISMATCH = "fingerprint_mismatch"
BUSY = "busy"
NO_SESSION = "no_session"
BAD_REQUEST = "bad_request"
NOT_READY = "not_ready"
INTERNAL = "internal"
UNAUTHENTICATED = "unauthenticated"   # the parent's own: the daemon refused its CURVE handshake (never on the wire)

# Payload dtype tag -> numpy dtype on the wire (bf16 travels as its raw uint16 bits).
PAYLOAD_DTYPES = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(np.uint16),
}
WIRE_ITEMSIZE = {dtype: wire.itemsize for dtype, wire in PAYLOAD_DTYPES.items()}
DTYPE_CODES = {dtype: code for code, dtype in enumerate(PAYLOAD_DTYPES)}   # binary slot headers, GPU kernels

# How COMPUTE requests travel: through a GPU daemon's device buffers exported over CUDA/HIP
# IPC ("device"), through a shared-memory arena ("shared"), or inside ZeroMQ frames ("stream").
# ATTACH sets up one of the first two.
TRANSPORTS = ("device", "shared", "stream")
ATTACH_TRANSPORTS = TRANSPORTS[:2]
MAX_BATCH_CAPACITY = 4096  # tokens one COMPUTE request may carry
COMPUTE_FRAMES = 4  # x [T, H], counts int32 [T], local_ids int32 [P], weights f32 [P]
MAX_PAIRS = 2**30


class ProtocolError(MoerunError):
    """A message this side cannot accept; becomes an error reply with `code` (and the
    message's request id, when it could be read)."""

    def __init__(self, code: str, message: str, request_id: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class DaemonError(MoerunError):
    """The daemon at `endpoint` answered a request with an error reply."""

    def __init__(self, code: str, message: str, endpoint: str):
        super().__init__(f"daemon {endpoint}: {code}: {message}")
        self.code = code
        self.message = message
        self.endpoint = endpoint


class DaemonTimeout(MoerunError, TimeoutError):
    """No reply from a daemon within the caller's deadline."""


class DaemonDied(MoerunError, RuntimeError):
    """The caller's liveness check reported the daemon gone while a request was pending."""


class DaemonUnreachable(MoerunError, ConnectionError):
    """Nothing accepts connections at a daemon's endpoint (refused, no socket file): no reply can come."""

    def __init__(self, endpoint: str, reason: str):
        super().__init__(f"daemon {endpoint}: {reason}")
        self.endpoint = endpoint
        self.reason = reason


def _plain(value):
    """msgpack fallback: numpy scalars become Python numbers."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot pack {type(value).__name__} into a header")


_packer = msgpack.Packer(default=_plain)


def pack_header(op: str, **fields) -> bytes:
    """One message header: {"v": PROTOCOL_VERSION, "op": op, **fields}."""
    return _packer.pack({"v": PROTOCOL_VERSION, "op": op, **fields})


def own_fields(header: dict) -> dict:
    """A header's fields without the ones every header carries ("v", "op", "id")."""
    return {name: value for name, value in header.items() if name not in ("v", "op", "id")}


def error_header(request_id, code: str, message: str) -> bytes:
    request_id = request_id if type(request_id) is int else None
    return pack_header(ERROR, id=request_id, code=code, message=message[:MAX_ERROR_MESSAGE])


def unpack_header(data, sender: str = "peer", receiver: str = "this side") -> dict:
    """Decode and sanity-check a header; raises ProtocolError (bad_frame, version_mismatch).
    `sender` and `receiver` name the two sides in a version-mismatch message."""
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(BAD_FRAME, f"header of {len(data)} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = msgpack.unpackb(data)
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types for garbage
        raise ProtocolError(BAD_FRAME,
                            f"header is not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(BAD_FRAME, f"header is a {type(header).__name__}, not a map")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise version_mismatch(version, sender, receiver, header.get("id"))
    if not isinstance(header.get("op"), str):
        raise ProtocolError(BAD_FRAME, "header has no string 'op'")
    return header


def version_mismatch(version, sender: str, receiver: str, request_id=None) -> ProtocolError:
    """The error for a message of another protocol version, naming both sides' versions."""
    return ProtocolError(VERSION_MISMATCH, f"protocol version mismatch: {sender} speaks version "
                                           f"{version!r}, {receiver} speaks version "
                                           f"{PROTOCOL_VERSION}", request_id)


def fingerprint_mismatch(parent: str, parent_model: str, daemon: str, daemon_model: str) -> str:
    """The message for a parent and a daemon of different models, naming both files."""
    files = [f"the parent runs {parent_model}" if parent_model else "", f"the daemon serves {daemon_model}"]
    return (f"model fingerprint mismatch: parent expects {parent!r}, daemon has {daemon!r} "
            f"({', '.join(filter(None, files))}: give both the same GGUF file)")


def host_identity() -> dict:
    """This process as HELLO names it: pid, hostname and the kernel boot id ("" off Linux)."""
    try:
        with open(BOOT_ID_PATH) as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return {"pid": os.getpid(), "hostname": socket.gethostname(), "boot_id": boot_id}


def int_field(header: dict, name: str, low: int, high: int | None = None) -> int:
    """header[name] as an int in [low, high]; raises ProtocolError(bad_request) otherwise."""
    value = header.get(name)
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ProtocolError(BAD_REQUEST, f"field {name!r} must be an int in {bound}, got {value!r}")
    return value


@functools.cache
def value_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a payload's values; ml_dtypes (slow to import) only once bf16 is used."""
    if dtype == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return PAYLOAD_DTYPES[dtype]


def encode_payload(x_f32: np.ndarray, dtype: str) -> np.ndarray:
    """The wire form of f32 activations: f32, f16, or bf16 as raw uint16 bits; contiguous."""
    return np.ascontiguousarray(x_f32, dtype=value_dtype(dtype)).view(PAYLOAD_DTYPES[dtype])


def decode_payload(buffer, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """f32 activations from a wire buffer (a read-only view for f32, a new array otherwise)."""
    values = np.frombuffer(buffer, dtype=value_dtype(dtype)).reshape(shape)
    return values if dtype == "f32" else values.astype(np.float32)


@dataclass(slots=True)
class ComputeRequest:
    layer: int
    x: np.ndarray          # f32 [T, H]
    counts: np.ndarray     # int32 [T], experts each token needs here
    local_ids: np.ndarray  # int32 [P], daemon-local expert ids, token-major
    weights: np.ndarray    # f32 [P]


def compute_header(request_id: int, layer: int, dtype: str, tokens: int, pairs: int,
                   hidden: int) -> bytes:
    return pack_header(COMPUTE, id=request_id, layer=layer, dtype=dtype, tokens=tokens,
                       pairs=pairs, hidden=hidden)


def result_header(request_id: int, layer: int, tokens: int, hidden: int,
                  compute_us: float) -> bytes:
    return pack_header(RESULT, id=request_id, layer=layer, tokens=tokens, hidden=hidden,
                       compute_us=compute_us)


def compute_frame_sizes(dtype: str, tokens: int, pairs: int, hidden: int) -> tuple[int, ...]:
    """Byte sizes of the four COMPUTE frames."""
    return tokens * hidden * WIRE_ITEMSIZE[dtype], tokens * 4, pairs * 4, pairs * 4


def parse_compute(header: dict, frames: list, *, hidden: int, max_tokens: int) -> ComputeRequest:
    """Validate a COMPUTE header and its frames (buffers); raises ProtocolError."""
    get = header.get
    layer, tokens, pairs, dtype = get("layer"), get("tokens"), get("pairs"), get("dtype")
    if not (type(layer) is int and type(tokens) is int and type(pairs) is int
            and type(get("hidden")) is int and layer >= 0 and 1 <= tokens <= max_tokens
            and 0 <= pairs <= MAX_PAIRS and get("hidden") == hidden and dtype in WIRE_ITEMSIZE):
        raise _compute_field_error(header, hidden, max_tokens)
    if len(frames) != COMPUTE_FRAMES:
        raise ProtocolError(BAD_FRAME, f"compute needs {COMPUTE_FRAMES} data frames "
                                       f"(x, counts, local_ids, weights), got {len(frames)}")
    x_frame, counts_frame, ids_frame, weights_frame = frames
    if (len(x_frame) != tokens * hidden * WIRE_ITEMSIZE[dtype] or len(counts_frame) != tokens * 4
            or len(ids_frame) != pairs * 4 or len(weights_frame) != pairs * 4):
        expected = list(compute_frame_sizes(dtype, tokens, pairs, hidden))
        raise ProtocolError(BAD_FRAME, f"frame sizes {[len(frame) for frame in frames]} bytes, "
                                       f"expected {expected} for T={tokens} P={pairs} "
                                       f"H={hidden} {dtype}")
    counts = np.frombuffer(counts_frame, dtype=np.int32)
    check_counts(counts, pairs)
    return ComputeRequest(layer, decode_payload(x_frame, dtype, (tokens, hidden)), counts,
                          np.frombuffer(ids_frame, dtype=np.int32),
                          np.frombuffer(weights_frame, dtype=np.float32))


def check_counts(counts: np.ndarray, pairs: int) -> None:
    """counts int32 [T] must be >= 0 and sum to P; raises ProtocolError(bad_request)."""
    # Seen as uint32 a negative count is >= 2**31 > MAX_PAIRS, so one sum checks both rules.
    total = counts[0] if len(counts) == 1 else counts.view(np.uint32).sum(dtype=np.uint64)
    if total != pairs:
        raise ProtocolError(BAD_REQUEST, f"counts must be >= 0 and sum to pairs={pairs}")


def _compute_field_error(header: dict, hidden: int, max_tokens: int) -> ProtocolError:
    """The first bad COMPUTE header field, as a ProtocolError."""
    try:
        int_field(header, "layer", 0)
        int_field(header, "tokens", 1, max_tokens)
        int_field(header, "pairs", 0, MAX_PAIRS)
        int_field(header, "hidden", hidden, hidden)
    except ProtocolError as e:
        return e
    return ProtocolError(BAD_REQUEST, f"unknown payload dtype {header.get('dtype')!r} "
                                      f"(known: {', '.join(PAYLOAD_DTYPES)})")


# -- a layer shard's FORWARD: the hidden state [T, H] at positions start.. of sequence
# `sequence` through the shard's layers; the reply (HIDDEN) carries the state after its last
# layer in the same payload dtype. start 0 begins a new sequence; any other start continues
# the sequence the shard holds, at exactly its length.

@dataclass(slots=True)
class ForwardRequest:
    sequence: int
    start: int
    dtype: str
    x: np.ndarray          # f32 [T, H]


def forward_header(request_id: int, sequence: int, start: int, dtype: str, tokens: int, hidden: int) -> bytes:
    return pack_header(FORWARD, id=request_id, sequence=sequence, start=start, dtype=dtype, tokens=tokens,
                       hidden=hidden)


def hidden_header(request_id: int, tokens: int, hidden: int, dtype: str, compute_us: float) -> bytes:
    return pack_header(HIDDEN, id=request_id, tokens=tokens, hidden=hidden, dtype=dtype, compute_us=compute_us)


def parse_forward(header: dict, frames: list, *, hidden: int, max_tokens: int) -> ForwardRequest:
    """Validate a FORWARD header and its one frame; raises ProtocolError."""
    sequence = int_field(header, "sequence", 0)
    start = int_field(header, "start", 0)
    tokens = int_field(header, "tokens", 1, max_tokens)
    int_field(header, "hidden", hidden, hidden)
    dtype = header.get("dtype")
    if dtype not in WIRE_ITEMSIZE:
        raise ProtocolError(BAD_REQUEST, f"unknown payload dtype {dtype!r} (known: {', '.join(PAYLOAD_DTYPES)})")
    if len(frames) != 1 or len(frames[0]) != tokens * hidden * WIRE_ITEMSIZE[dtype]:
        raise ProtocolError(BAD_FRAME, f"forward needs one frame of {tokens * hidden * WIRE_ITEMSIZE[dtype]} "
                                       f"bytes (x [{tokens}, {hidden}] {dtype}), got "
                                       f"{[len(frame) for frame in frames]}")
    return ForwardRequest(sequence, start, dtype, decode_payload(frames[0], dtype, (tokens, hidden)))
