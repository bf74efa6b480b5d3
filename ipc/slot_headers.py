"""The binary headers inside a shared-memory slot (docs/protocol.md §5): a COMPUTE request at
REQUEST_HEADER_OFFSET and its RESULT or ERROR reply at REPLY_HEADER_OFFSET, each a fixed
little-endian struct read or written in one call. The frames sit at fixed places in the slot,
so the headers carry no frame table. Control messages stay msgpack over ZeroMQ.

Shape legend: T tokens, H hidden size, P routed pairs.
"""
from __future__ import annotations

import struct

from moerun.ipc import protocol as p
from moerun.ipc.protocol import ProtocolError
from moerun.ipc.shm import REPLY_HEADER_OFFSET, REQUEST_HEADER_OFFSET, ArenaLayout

OP_COMPUTE, OP_RESULT, OP_ERROR, OP_COMPUTE_PADDED = 1, 2, 3, 4
COMPUTE_OPS = (OP_COMPUTE, OP_COMPUTE_PADDED)
DTYPES = ("f32", "f16", "bf16")                  # a payload dtype's code is its position
DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
ERROR_CODES = (p.BAD_FRAME, p.VERSION_MISMATCH, p.FINGERPRINT_MISMATCH, p.BUSY, p.NO_SESSION,
               p.BAD_REQUEST, p.NOT_READY, p.INTERNAL)   # an error code's number: position + 1
ERROR_NUMBERS = {code: number for number, code in enumerate(ERROR_CODES, start=1)}

# version, op, request id, layer, dtype code, tokens T, pairs P, hidden H
REQUEST = struct.Struct("<IIQiIIII")
# version, op, request id, layer, tokens T, hidden H, error number, compute_us, message bytes
REPLY = struct.Struct("<IIQiIIIdI")
REQUEST_ID = struct.Struct("<Q")
REQUEST_ID_OFFSET = REQUEST_HEADER_OFFSET + 8
MESSAGE_OFFSET = REPLY_HEADER_OFFSET + REPLY.size
MAX_MESSAGE_BYTES = 4 * p.MAX_ERROR_MESSAGE      # UTF-8 of MAX_ERROR_MESSAGE characters


def write_request(slot_buffer, request_id: int, layer: int, dtype: str, tokens: int,
                  pairs: int, hidden: int, padded: bool = False) -> None:
    """A ragged request (counts [T], local_ids and weights [P]) or a padded one (ids and
    weights [T, K], -1: no expert; P = T * K), which a GPU parent writes from the device."""
    op = OP_COMPUTE_PADDED if padded else OP_COMPUTE
    REQUEST.pack_into(slot_buffer, REQUEST_HEADER_OFFSET, p.PROTOCOL_VERSION, op,
                      request_id, layer, DTYPE_CODES[dtype], tokens, pairs, hidden)


def request_id(slot_buffer) -> int:
    """The request id, readable whatever else the header holds (every reply echoes it)."""
    return REQUEST_ID.unpack_from(slot_buffer, REQUEST_ID_OFFSET)[0]


def read_request(slot_buffer, layout: ArenaLayout) -> tuple[int, str, int, int, bool]:
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


def write_result(slot_buffer, request_id: int, layer: int, tokens: int, hidden: int,
                 compute_us: float) -> None:
    REPLY.pack_into(slot_buffer, REPLY_HEADER_OFFSET, p.PROTOCOL_VERSION, OP_RESULT, request_id,
                    layer, tokens, hidden, 0, compute_us, 0)


def write_error(slot_buffer, request_id: int, code: str, message: str) -> None:
    text = message[:p.MAX_ERROR_MESSAGE].encode("utf-8", "replace")
    REPLY.pack_into(slot_buffer, REPLY_HEADER_OFFSET, p.PROTOCOL_VERSION, OP_ERROR, request_id,
                    0, 0, 0, ERROR_NUMBERS[code], 0.0, len(text))
    slot_buffer[MESSAGE_OFFSET:MESSAGE_OFFSET + len(text)] = text


def read_reply(slot_buffer) -> tuple[int, int, int, float, tuple[str, str] | None]:
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
