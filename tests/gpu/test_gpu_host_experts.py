"""A GPU parent with the experts of a CPU daemon in host RAM: prefill chunks that stream those
experts to the GPU and compute them there, the expert cache that keeps the ones routing favours
on the GPU, and the share the GPU reads in place, against the same model all on the GPU."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.reader import GGUFFile
from moerun.models import load_spec
from moerun.moe.planner import model_sizes
from moerun.rig.settings import RigConfig
from moerun.writers.bench_model import MIXES, PRESETS, write_bench_model
from tests.support.gpu import INT_GEMV_BOUND, gpu_device

pytestmark = pytest.mark.gpu
HOT = 2                          # of the tiny model's 8 experts per layer: 6 in host RAM, 12 over its 2 layers
GREEDY = SamplingParams(temperature=0.0)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def with_cpu_daemon(**settings) -> RigConfig:
    """Streaming, the cache and reads in place off unless `settings` turn them on."""
    return RigConfig(**{"device": gpu_device(), "daemons": ("cpu",), "hot": HOT, "daemon_timeout_s": 60,
                        "require_daemons": True, "stream_threshold": "off", "gpu_reads": "off", **settings})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_bench_model(tmp_path_factory.mktemp("host") / "tiny.gguf", PRESETS["tiny"], MIXES["q4_k_m"], seed=7)


@pytest.fixture(scope="module")
def all_local(model):
    """The all-GPU figures: logits of a 40-token prompt in chunks of 512 and of 8, greedy tokens."""
    ids = np.random.default_rng(4).integers(0, 800, 40).tolist()
    figures = {"ids": ids}
    for ubatch in (8, 512):
        with Runtime(model, ubatch=ubatch, rig=RigConfig(device=gpu_device())) as local:
            figures[ubatch] = local.logits(ids)
            if ubatch == 8:
                figures["tokens"] = list(local.generate(ids[:8], 24, GREEDY))
    return figures


@pytest.mark.parametrize("ubatch, bound", [(8, INT_GEMV_BOUND), (512, 1e-3)], ids=["gemv", "tiles"])
def test_streamed_prefill_computes_the_daemons_experts_on_the_gpu(model, all_local, ubatch, bound):
    """Every chunk streams (threshold 2): the daemon gets no call, every host pair is streamed."""
    with Runtime(model, ubatch=ubatch, rig=with_cpu_daemon(stream_threshold="2", gpu_reads="0.5")) as streamed:
        got = streamed.logits(all_local["ids"])
        stats = streamed.moe_stats()
        calls = streamed.rig.links[0].client.counters.calls
    assert relative_error(got, all_local[ubatch]) <= bound
    assert calls == 0 and stats.remote_pairs == 0 and stats.fallback_pairs == 0
    assert stats.host.streamed_pairs == stats.host.host_pairs > 0
    assert stats.host.streamed_layers == 2 * -(-40 // ubatch)


def test_streamed_prefill_then_decode_on_the_daemon_gives_the_same_tokens(model, all_local):
    with Runtime(model, ubatch=8, rig=with_cpu_daemon(stream_threshold="2")) as streamed:
        tokens = list(streamed.generate(all_local["ids"][:8], 24, GREEDY))
        stats = streamed.moe_stats()
    assert tokens == all_local["tokens"]
    assert stats.host.streamed_pairs > 0 and stats.remote_pairs > 0
    assert stats.host.host_pairs == stats.host.streamed_pairs + stats.remote_pairs


@pytest.mark.parametrize("cached, reads", [(1, "off"), (6, "0.5"), (12, "off")],
                         ids=["one-expert", "one-layer-with-reads", "every-host-expert"])
def test_an_expert_cache_of_any_size_changes_no_logit_or_token(model, all_local, cached, reads):
    """A cache of one expert (smaller than a layer's), of a layer's worth (beside reads in place:
    an expert leaving the cache goes back to the GPU's reads or to the daemon, as before), and of
    every host expert: decode fills it from the routing counts; its hits run on the GPU with the
    hot experts; logits and greedy tokens stay the all-local ones."""
    with GGUFFile(model) as gguf:
        expert_bytes = model_sizes(gguf, load_spec(gguf)).expert_bytes[0]
    rig = with_cpu_daemon(expert_cache_bytes=cached * expert_bytes, gpu_reads=reads)
    with Runtime(model, ubatch=8, rig=rig) as runtime:
        tokens = list(runtime.generate(all_local["ids"][:8], 24, GREEDY))
        got = runtime.logits(all_local["ids"])          # a prefill through the filled cache
        stats = runtime.moe_stats()
        cache = runtime.model.executor.cache
    assert tokens == all_local["tokens"]
    assert relative_error(got, all_local[8]) <= INT_GEMV_BOUND
    assert sum(cache.slots.values()) == cached
    assert cache.swaps > 0 and stats.host.cache_hits > 0
    assert stats.host.host_pairs == stats.host.cache_hits + stats.host.read_pairs + stats.remote_pairs
    assert (stats.host.read_pairs > 0) == (reads != "off")
    if cached == 12:                                     # room for every host expert: none ever leaves
        assert cache.swaps <= 12


@pytest.mark.parametrize("share", ["0.5", "1"])
def test_reads_in_place_change_no_logit_or_token(model, all_local, share):
    """The GPU multiplies a share of the host experts reading their weights in host RAM across
    the bus (in eager steps, captured ones and prefill chunks); the daemon computes the rest."""
    with Runtime(model, ubatch=8, rig=with_cpu_daemon(gpu_reads=share)) as runtime:
        tokens = list(runtime.generate(all_local["ids"][:8], 24, GREEDY))
        got = runtime.logits(all_local["ids"])
        stats = runtime.moe_stats()
    assert tokens == all_local["tokens"]
    assert relative_error(got, all_local[8]) <= INT_GEMV_BOUND
    assert stats.host.read_pairs > 0 and stats.host.host_pairs == stats.host.read_pairs + stats.remote_pairs
    assert (stats.remote_pairs == 0) == (share == "1")


def test_the_auto_threshold_measures_the_copy_and_the_daemon(model, all_local):
    """auto: probe requests to the daemon and a timed copy give every host layer a streaming
    threshold; with the cache and reads in place too the logits stay all-local's."""
    with GGUFFile(model) as gguf:
        expert_bytes = model_sizes(gguf, load_spec(gguf)).expert_bytes[0]
    rig = with_cpu_daemon(expert_cache_bytes=3 * expert_bytes, stream_threshold="auto", gpu_reads="0.5")
    with Runtime(model, ubatch=512, rig=rig) as runtime:
        thresholds = runtime.model.executor.streamer.tokens
        got = runtime.logits(all_local["ids"])
        probes = runtime.rig.links[0].client.counters.calls
    assert sorted(thresholds) == [0, 1] and all(t >= 2 for t in thresholds.values())
    assert probes >= 5                                   # the probe requests
    assert relative_error(got, all_local[512]) <= 1e-3


@pytest.mark.parametrize("cached", [12, 24], ids=["half", "every-host-expert"])
def test_streamed_chunks_copy_only_the_experts_the_cache_does_not_hold(tmp_path, cached):
    """Four host layers through two streaming buffers, so each chunk copies every layer anew: once
    decode has filled the cache (half of the host experts, or all: then a layer may have nothing
    to copy), a streamed chunk copies only the experts it does not hold, and the logits and tokens
    stay all-local's."""
    model = write_bench_model(tmp_path / "four.gguf", replace(PRESETS["tiny"], n_layers=4), MIXES["q4_k_m"], seed=7)
    ids = np.random.default_rng(5).integers(0, 800, 40).tolist()
    with Runtime(model, ubatch=16, rig=RigConfig(device=gpu_device())) as local:
        want_tokens = list(local.generate(ids[:8], 24, GREEDY))
        want = local.logits(ids)
    with GGUFFile(model) as gguf:
        expert_bytes = model_sizes(gguf, load_spec(gguf)).expert_bytes[0]
    rig = with_cpu_daemon(expert_cache_bytes=cached * expert_bytes, stream_threshold="2")    # of 4 × 6
    with Runtime(model, ubatch=16, rig=rig) as runtime:
        tokens = list(runtime.generate(ids[:8], 24, GREEDY))
        streamer, cache = runtime.model.executor.streamer, runtime.model.executor.cache
        layers_before, bytes_before = streamer.layers_streamed, streamer.bytes_streamed
        got = runtime.logits(ids)
        layers, copied = streamer.layers_streamed - layers_before, streamer.bytes_streamed - bytes_before
        held = sum(int((resident >= 0).sum()) for resident in cache.resident.values())
    assert tokens == want_tokens
    assert relative_error(got, want) <= 1e-3
    assert layers == 4 * 3 and held > 0
    assert copied <= (4 * 6 * 3 - held * 3 + 2 * 6) * expert_bytes        # 3 chunks; 2 layers may be copied whole ahead
    assert (copied > 0) == (held < 4 * 6)                                 # nothing to copy once the cache holds all
