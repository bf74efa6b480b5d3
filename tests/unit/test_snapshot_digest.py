"""A snapshot file's digest: written from the arrays' own buffers (parts), checked over the
file's bytes read back whole — the same digest however the bytes are cut into parts."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from moerun.engine import snapshot_store
from moerun.engine.snapshot_store import digest


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
