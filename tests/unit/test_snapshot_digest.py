"""A snapshot file's digest: written from the arrays' own buffers (parts), checked over the
file's bytes read back whole — the same digest however the bytes are cut into parts."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from moerun.engine import snapshot_store
from moerun.engine.snapshot_store import digest, read_body


@pytest.mark.parametrize("seed", range(6))
def test_parts_give_the_digest_of_their_concatenation(monkeypatch, seed):
    monkeypatch.setattr(snapshot_store, "DIGEST_BLOCK", 64)           # many blocks, many crossings
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, int(rng.integers(0, 1000)), dtype=np.uint8).tobytes()
    cuts = np.sort(rng.integers(0, len(data) + 1, int(rng.integers(0, 12))))
    parts = [memoryview(data[a:b]) for a, b in zip([0, *cuts], [*cuts, len(data)])]
    assert digest(parts) == digest([memoryview(data)])


def test_the_digest_is_of_the_blocks_digests(monkeypatch):
    monkeypatch.setattr(snapshot_store, "DIGEST_BLOCK", 4)
    data = bytes(range(10))
    blocks = [data[0:4], data[4:8], data[8:10]]
    want = hashlib.blake2b(b"".join(hashlib.blake2b(b, digest_size=32).digest() for b in blocks),
                           digest_size=32).digest()
    assert digest([memoryview(data)]) == want
    assert digest([memoryview(np.arange(5, dtype=np.float16).view(np.uint8))]) != digest([memoryview(data)])


@pytest.mark.parametrize("size", [200, 64 * 7, 1000])
def test_a_file_read_back_by_blocks_checks_against_its_digest(monkeypatch, tmp_path, size):
    monkeypatch.setattr(snapshot_store, "DIGEST_BLOCK", 64)
    body = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "snap"
    path.write_bytes(body + digest([memoryview(body)]))
    read, matches = read_body(path)
    assert bytes(read) == body and matches()
    damaged = bytearray(body)
    damaged[size - 1] ^= 1                                           # in the last block
    path.write_bytes(bytes(damaged) + digest([memoryview(body)]))
    read, matches = read_body(path)
    assert bytes(read) == bytes(damaged) and not matches()
    path.write_bytes(body[:20])
    with pytest.raises(ValueError, match="truncated"):
        read_body(path)
