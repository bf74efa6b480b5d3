"""Padded slot requests (ids and weights [T, K], -1 for no expert: what a GPU parent writes)
served by a real CPU daemon process in place, its experts' pairs handed to the kernels as
they are (f32 ones by the kernels' own loop over the arena, the others from Python): the
result against the float32 reference over the same experts, and a bad local id as an error
reply (the loop leaves it to Python). Shape legend: T tokens, H hidden, K slots, E experts."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.backends.numpy_backend import DequantizedExperts
from moerun.gguf.reader import GGUFFile
from moerun.ipc.client import DaemonClient, DaemonError
from moerun.models import load_spec
from tests.support.daemon_fixtures import running_daemons
from tests.support.hf_models import tiny_model
from tests.support.to_gguf import write_gguf

TOP_K = 6                       # slots per token, more than the model's K: padding on every token
LAYER = 1
HELD = [7, 2, 5, 0]             # the daemon's local ids 0..3 are these global ids


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(a running daemon's endpoint, the model file's fingerprint and spec, its float32 reference experts)."""
    folder = tmp_path_factory.mktemp("padded")
    path = write_gguf(tiny_model("qwen3moe", seed=5), folder / "model.gguf", "Q8_0")
    with GGUFFile(path) as gguf, running_daemons(path, 1, folder) as endpoints:
        spec = load_spec(gguf)
        yield endpoints[0], gguf.fingerprint(), spec, DequantizedExperts(gguf, spec, cache_bytes=1 << 30)


@pytest.fixture
def daemon(model):
    """(a client attached over shared memory, the spec, the reference experts)."""
    endpoint, fingerprint, spec, reference = model
    with DaemonClient(endpoint, connect_timeout_s=30) as client:
        client.hello(fingerprint)
        client.assign({layer: HELD for layer in range(spec.n_layers) if spec.moe_layers[layer]})
        client.attach_shared(batch_capacity=16, hidden=spec.hidden, max_pairs_per_token=TOP_K)
        yield client, spec, reference
        client.bye()                                             # the next test's session


def post_padded(client: DaemonClient, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, dtype: str) -> int:
    """The frames written straight into slot 1, as the parent's pack kernel writes them."""
    frames = client.arena.slots[1]
    frames.write_x(dtype, x)
    frames._local_ids[:ids.size] = ids.reshape(-1)
    frames._weights[:weights.size] = weights.reshape(-1)
    return client.post(1, LAYER, dtype, len(x))


@pytest.mark.parametrize("tokens, dtype", [(1, "f32"), (5, "f32"), (16, "f32"), (5, "f16")])
def test_a_padded_request_equals_the_float32_reference(daemon, tokens, dtype):
    client, spec, reference = daemon
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, spec.hidden)).astype(np.float32)
    ids = np.full((tokens, TOP_K), -1, np.int32)             # each token's experts here distinct, in random slots
    for row in ids:
        here = rng.permutation(len(HELD))[:rng.integers(1, len(HELD) + 1)]
        row[rng.permutation(TOP_K)[:len(here)]] = here
    ids[0] = -1                                                  # a token with nothing here
    weights = rng.random((tokens, TOP_K)).astype(np.float32)
    before = client.stats()
    client.collect(post_padded(client, x, ids, weights, dtype), timeout_s=30)
    got = client.arena.slots[1].read_result(tokens)
    sent = x.astype(np.float16).astype(np.float32) if dtype == "f16" else x
    rows, slots = np.nonzero(ids >= 0)
    want = reference.grouped_ffn(LAYER, sent, rows, np.array(HELD)[ids[rows, slots]], weights[rows, slots])
    assert np.all(got[0] == 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert client.slot_idle(1)
    after = client.stats()
    assert after["calls"] - before["calls"] == 1
    assert after["loop_calls"] - before["loop_calls"] == (dtype == "f32")     # f32: the compiled loop's


def test_a_padded_request_with_a_bad_local_id_is_an_error_reply(daemon):
    client, spec, _ = daemon
    ids = np.full((2, TOP_K), -1, np.int32)
    ids[1, 3] = len(HELD)                                        # one past the daemon's experts of the layer
    with pytest.raises(DaemonError, match=f"layer {LAYER}: .*expert id out of range.*holds {len(HELD)}"):
        client.collect(post_padded(client, np.ones((2, spec.hidden), np.float32), ids,
                                   np.ones((2, TOP_K), np.float32), "f32"), timeout_s=30)
    assert client.slot_idle(1)
