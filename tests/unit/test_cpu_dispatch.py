"""moerun.rig.cpu_dispatch.CpuDispatcher without a Runtime: a placement made by hand, two real
fake daemon processes (tests/support/fake_daemon.py; d0 over ZeroMQ frames, d1 through a
shared arena) behind real DaemonClients, and parent experts whose FFNs are scalings, so each
part of a layer's output can be predicted here:

- a parent expert g of layer l:  FFN(x) = x · (10 + g + l/4)   (every_expert(): the same, by global id)
- a daemon expert at local id j: FFN(x) = x · (l + 1) · (j + 1)  (FakeHandler)

Shape legend: T tokens, H hidden, E experts, K experts per token, P routed pairs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import pytest

from moerun.ipc.client import DaemonClient
from moerun.moe.placement import PARENT, Placement
from moerun.rig.cpu_dispatch import CpuDispatcher
from moerun.rig.links import DaemonLink, RigError
from moerun.rig.settings import RigConfig
from tests.support.fake_daemon import FINGERPRINT, HIDDEN, daemon_process

E, K, CAPACITY = 8, 2, 64
# layer -> home of each expert [E]: layer 0 mixed, layer 1 all on the parent, layer 2 without d1.
HOMES = {0: [-1, 0, 1, -1, 1, 0, 0, 1],
         1: [-1] * E,
         2: [0, -1, 0, -1, 0, -1, -1, 0]}


def held_by(home: int) -> dict[int, list[int]]:
    """Global ids per layer at `home`, ascending (their positions are the local ids)."""
    return {layer: [e for e in range(E) if row[e] == home] for layer, row in HOMES.items()
            if home in row}


def parent_factor(layer: int, expert: int) -> float:
    return 10.0 + expert + layer / 4


class ScalingExperts:
    """The parent's experts (held: local ids per layer) or every expert (held None: global ids)."""

    def __init__(self, held: dict[int, list[int]] | None, log: list):
        self.held, self.log = held, log

    def every_expert(self) -> ScalingExperts:
        return ScalingExperts(None, self.log)

    def compute(self, layer, x, ids, weights, out=None):
        """x [T, H], ids/weights [T, K] (ids -1: not here) -> [T, H]"""
        self.log.append(("every" if self.held is None else "parent", layer, ids.copy()))
        result = np.zeros_like(x)
        for t, k in zip(*np.nonzero(ids >= 0)):
            expert = ids[t, k] if self.held is None else self.held[layer][ids[t, k]]
            result[t] += weights[t, k] * parent_factor(layer, expert) * x[t]
        if out is None:
            return result
        out[...] = result
        return out


class RecordingClient(DaemonClient):
    """A real client that also keeps what each submit carried."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent = []

    def submit(self, layer, x, counts, local_ids, weights, dtype, **kwargs):
        self.sent.append((layer, x.copy(), np.array(counts), np.array(local_ids), np.array(weights), dtype))
        return super().submit(layer, x, counts, local_ids, weights, dtype, **kwargs)


@dataclass
class StandInRig:
    """What CpuDispatcher uses of moerun.rig.supervisor.Rig."""
    placement: Placement
    config: RigConfig
    links: list[DaemonLink]
    downs: list = field(default_factory=list)

    def mark_down(self, link: DaemonLink, reason: str) -> None:
        self.downs.append((link.index, reason))
        link.up, link.down_reason = False, reason

    def check(self) -> None:
        if self.config.require_daemons and not all(link.up for link in self.links):
            raise RigError("a daemon is down")


@pytest.fixture(scope="module")
def daemons():
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(daemon_process("--capacity", str(CAPACITY))) for _ in range(2)]


@pytest.fixture
def make_rig(daemons):
    """make_rig(config, assigned=None) -> (dispatcher, rig, parent log); d1 uses a shared arena."""
    clients = []

    def make(config: RigConfig, assigned: dict[int, dict] | None = None):
        links = []
        for d, daemon in enumerate(daemons):
            client = RecordingClient(daemon.endpoint, connect_timeout_s=10)
            clients.append(client)
            client.hello(FINGERPRINT)
            client.assign((assigned or {}).get(d, held_by(d)))
            if d == 1:
                client.attach_shared(batch_capacity=CAPACITY, hidden=HIDDEN, max_pairs_per_token=K)
            links.append(DaemonLink(index=d, spec=daemon.endpoint, client=client, local=None,
                                    transport=client.transport))
        assert [link.transport for link in links] == ["stream", "shared"]
        placement = Placement({layer: np.array(row, np.int16) for layer, row in HOMES.items()},
                              tuple(daemon.endpoint for daemon in daemons))
        rig = StandInRig(placement, config, links)
        log = []
        return CpuDispatcher(rig, ScalingExperts(held_by(PARENT), log)), rig, log

    yield make
    for client in clients:
        client.bye()
        client.close()


def routing(tokens: int, seed: int, experts=range(E)):
    """ids [T, K] distinct per token, weights [T, K] f32, x [T, H] f32."""
    rng = np.random.default_rng(seed)
    pool = np.array(list(experts))
    ids = np.stack([rng.choice(pool, K, replace=False) for _ in range(tokens)]).astype(np.int64)
    weights = rng.random((tokens, K)).astype(np.float32)
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    return x, ids, weights


def to_daemon(x, dtype):
    return {"f32": x, "bf16": x.astype(ml_dtypes.bfloat16).astype(np.float32),
            "f16": x.astype(np.float16).astype(np.float32)}[dtype]


def reference(layer, x, ids, weights, down=(), dtype="f32") -> np.ndarray:
    """float64 [T, H]: each pair's expert by its home; a down daemon's pairs by the parent."""
    out = np.zeros(x.shape, np.float64)
    for t in range(len(ids)):
        for k in range(K):
            expert, home = int(ids[t, k]), HOMES[layer][ids[t, k]]
            if home == PARENT or home in down:
                out[t] += weights[t, k] * parent_factor(layer, expert) * x[t].astype(np.float64)
            else:
                local = held_by(home)[layer].index(expert)
                out[t] += (weights[t, k] * (layer + 1) * (local + 1)
                           * to_daemon(x[t:t + 1], dtype)[0].astype(np.float64))
    return out


def expected_requests(layer, ids, weights, daemon):
    """What `daemon` must be sent: token rows [T_d], counts [T_d], local ids [P_d], weights [P_d]."""
    rows = [t for t in range(len(ids)) if any(HOMES[layer][e] == daemon for e in ids[t])]
    pairs = [(t, k) for t in rows for k in range(K) if HOMES[layer][ids[t, k]] == daemon]
    counts = [sum(1 for p in pairs if p[0] == t) for t in rows]
    local = [held_by(daemon)[layer].index(int(ids[t, k])) for t, k in pairs]
    return rows, counts, local, [weights[t, k] for t, k in pairs]


def sent_to(client: RecordingClient):
    """Everything the client sent, joined: layer set, x rows, counts, local ids, weights."""
    return ({s[0] for s in client.sent}, np.concatenate([s[1] for s in client.sent]),
            np.concatenate([s[2] for s in client.sent]).tolist(), np.concatenate([s[3] for s in client.sent]).tolist(),
            np.concatenate([s[4] for s in client.sent]))


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_mixed_layer_sends_each_daemon_only_its_rows(make_rig, dtype):
    dispatcher, rig, log = make_rig(RigConfig(batch_capacity=CAPACITY, payload_dtype=dtype, daemon_timeout_s=10))
    x, ids, weights = routing(40, seed=1)                                    # [T, H], [T, K], [T, K]
    computes = [link.client.stats()["computes"] for link in rig.links]
    pending = dispatcher.begin(0, x, ids, weights)
    assert log == []                                  # the daemons' work went out before the parent's
    for d, link in enumerate(rig.links):
        rows, counts, local, pair_weights = expected_requests(0, ids, weights, d)
        assert 0 < len(rows) < len(ids)               # some rows need this daemon, some do not
        layers, sent_x, sent_counts, sent_local, sent_weights = sent_to(link.client)
        assert len(link.client.sent) == link.client.counters.calls == 1
        assert layers == {0} and link.client.sent[0][5] == dtype
        np.testing.assert_array_equal(sent_x, x[rows])
        assert sent_counts == counts and sent_local == local
        np.testing.assert_array_equal(sent_weights, np.array(pair_weights, np.float32))
    out = pending.finish()
    assert out.shape == x.shape and out.dtype == np.float32
    close(out, reference(0, x, ids, weights, dtype=dtype))
    # the parent computed its own pairs only, by its local ids
    (kind, layer, parent_ids), = log
    want_parent = [[held_by(PARENT)[0].index(e) if HOMES[0][e] == PARENT else -1 for e in row] for row in ids]
    assert (kind, layer, parent_ids.tolist()) == ("parent", 0, want_parent)
    assert [link.client.stats()["computes"] - c for link, c in zip(rig.links, computes)] == [1, 1]
    assert rig.downs == []


@pytest.mark.parametrize("layer, experts", [(1, range(E)), (0, [0, 3]), (2, [1, 3, 5, 6])])
def test_a_layer_all_on_the_parent_sends_nothing(make_rig, layer, experts):
    """Layer 1 holds every expert on the parent; in the others the routing only reaches parent experts."""
    dispatcher, rig, log = make_rig(RigConfig(batch_capacity=CAPACITY, daemon_timeout_s=10))
    x, ids, weights = routing(12, seed=2, experts=experts)
    sent_before = [link.client.counters.bytes_sent for link in rig.links]    # the handshake's
    out = dispatcher.begin(layer, x, ids, weights).finish()
    close(out, reference(layer, x, ids, weights))
    assert [link.client.counters.calls for link in rig.links] == [0, 0]
    assert [link.client.counters.bytes_sent for link in rig.links] == sent_before
    counts = dispatcher.counts()
    assert (counts.remote_layer_calls, counts.remote_pairs, counts.fallback_pairs) == (0, 0, 0)
    assert [entry[0] for entry in log] == ["parent"]


def test_a_daemon_without_pairs_in_the_layer_gets_no_request(make_rig):
    dispatcher, rig, _ = make_rig(RigConfig(batch_capacity=CAPACITY, daemon_timeout_s=10))
    x, ids, weights = routing(16, seed=3)
    out = dispatcher.begin(2, x, ids, weights).finish()                     # d1 holds nothing in layer 2
    close(out, reference(2, x, ids, weights))
    assert rig.links[0].client.counters.calls == 1 and rig.links[1].client.counters.calls == 0


def test_counts_follow_the_layer_calls(make_rig):
    dispatcher, rig, _ = make_rig(RigConfig(batch_capacity=CAPACITY, daemon_timeout_s=10))
    calls = [(0, 9, range(E)), (1, 5, range(E)), (2, 7, range(E)), (0, 6, [0, 3]), (0, 1, range(E)), (2, 20, range(E))]
    layer_calls = pairs = 0
    for seed, (layer, tokens, experts) in enumerate(calls):
        x, ids, weights = routing(tokens, seed=10 + seed, experts=experts)
        remote = sum(HOMES[layer][e] != PARENT for e in ids.ravel())
        layer_calls, pairs = layer_calls + (remote > 0), pairs + remote
        close(dispatcher.begin(layer, x, ids, weights).finish(), reference(layer, x, ids, weights))
    counts = dispatcher.counts()
    assert (counts.remote_layer_calls, counts.remote_pairs, counts.fallback_pairs) == (layer_calls, pairs, 0)
    assert layer_calls >= 3 and pairs > 0


def test_tokens_per_call_splits_a_long_batch(make_rig):
    config = RigConfig(mode="stream", daemon_timeout_s=10)                 # 4 tokens per call
    dispatcher, rig, _ = make_rig(config)
    x, ids, weights = routing(30, seed=4)
    close(dispatcher.begin(0, x, ids, weights).finish(), reference(0, x, ids, weights))
    for d, link in enumerate(rig.links):
        rows, counts, local, _ = expected_requests(0, ids, weights, d)
        sizes = [len(s[2]) for s in link.client.sent]
        assert sizes == [config.tokens_per_call] * (len(rows) // config.tokens_per_call) + (
            [len(rows) % config.tokens_per_call] if len(rows) % config.tokens_per_call else [])
        assert link.client.counters.calls == len(sizes) > 1
        _, sent_x, sent_counts, sent_local, _ = sent_to(link.client)
        np.testing.assert_array_equal(sent_x, x[rows])
        assert sent_counts == counts and sent_local == local


def test_a_link_that_is_down_gets_its_pairs_computed_by_the_parent(make_rig):
    dispatcher, rig, log = make_rig(RigConfig(batch_capacity=CAPACITY, daemon_timeout_s=10))
    down = rig.links[1]
    down.up = False
    x, ids, weights = routing(24, seed=5)
    out = dispatcher.begin(0, x, ids, weights).finish()
    close(out, reference(0, x, ids, weights, down=(1,)))
    assert down.client.counters.calls == 0 and rig.links[0].client.counters.calls == 1
    # every_expert() got exactly d1's pairs, by global id
    want = np.where(np.array([[HOMES[0][e] == 1 for e in row] for row in ids]), ids, -1)
    assert [(kind, layer) for kind, layer, _ in log] == [("parent", 0), ("every", 0)]
    np.testing.assert_array_equal(log[1][2], want)
    d1_pairs = int((want >= 0).sum())
    counts = dispatcher.counts()
    assert (counts.remote_layer_calls, counts.remote_pairs, counts.fallback_pairs) == (
        1, sum(HOMES[0][e] != PARENT for e in ids.ravel()), d1_pairs)
    assert down.fallback_calls == 1 and rig.links[0].fallback_calls == 0
    assert rig.downs == []                            # it was down already


def test_a_daemon_answering_an_error_is_marked_down_and_its_pairs_computed_here(make_rig):
    """d0 is given only the first of its layer-0 experts, so local ids 1 and 2 are an error there."""
    assigned = {0: {**held_by(0), 0: held_by(0)[0][:1]}}
    dispatcher, rig, log = make_rig(RigConfig(batch_capacity=CAPACITY, daemon_timeout_s=10), assigned)
    x, ids, weights = routing(24, seed=6)
    out = dispatcher.begin(0, x, ids, weights).finish()
    close(out, reference(0, x, ids, weights, down=(0,)))
    ((index, reason),) = rig.downs
    assert index == 0 and not rig.links[0].up and "local expert id out of" in reason
    assert rig.links[0].fallback_calls == 1 and rig.links[1].up
    assert dispatcher.counts().fallback_pairs == sum(HOMES[0][e] == 0 for e in ids.ravel())
    # the next layer call leaves d0 alone
    calls = rig.links[0].client.counters.calls
    close(dispatcher.begin(0, x, ids, weights).finish(), reference(0, x, ids, weights, down=(0,)))
    assert rig.links[0].client.counters.calls == calls


def test_with_require_daemons_a_failing_daemon_stops_the_layer(make_rig):
    assigned = {0: {**held_by(0), 0: held_by(0)[0][:1]}}
    dispatcher, rig, _ = make_rig(RigConfig(batch_capacity=CAPACITY, daemon_timeout_s=10, require_daemons=True),
                                  assigned)
    x, ids, weights = routing(24, seed=6)
    with pytest.raises(RigError):
        dispatcher.begin(0, x, ids, weights).finish()
    assert [index for index, _ in rig.downs] == [0]
