"""Layer shards (--split): the layers from each boundary on run in real shard processes
(`moerun daemon --layers A:B`) spawned or started by hand, the hidden state crossing their
sockets; the logits and greedy tokens equal all-local, with expert daemons too, and a shard
killed mid-request fails that request clearly and the next one is right."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys

import numpy as np
import pytest

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.ipc.client import DaemonClient, DaemonError
from moerun.rig.links import RigError
from moerun.rig.settings import ConfigError, RigConfig
from moerun.rig.shards import ShardFailed
from tests.support.daemon_fixtures import wait_for_socket
from tests.support.hf_models import tiny_model
from tests.support.to_gguf import write_gguf

PROMPT = np.random.default_rng(11).integers(0, 320, 19).tolist()
BOUNDS = {"f32": 1e-5, "f16": 2e-3, "bf16": 2e-2}    # max |split - local| / max |local|, as for daemons
UBATCH = 8                                           # several prefill chunks
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["qwen3moe", "qwen35moe"])
def model(request, tmp_path_factory):
    """(4-layer model path, all-local logits, all-local greedy tokens)."""
    path = write_gguf(tiny_model(request.param, seed=4, num_hidden_layers=4),
                      tmp_path_factory.mktemp(request.param) / "model.gguf", "F32")
    with Runtime(path, ubatch=UBATCH) as local:
        yield path, local.logits(PROMPT), list(local.generate(PROMPT[:5], 64, GREEDY))


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("boundaries", [(2,), (1, 3), (1, 2, 3)], ids=["1 shard", "2 shards", "3 shards"])
def test_shards_give_the_all_local_logits_and_tokens(model, boundaries):
    path, want_logits, want_tokens = model
    rig = RigConfig(splits=tuple(("cpu", layer) for layer in boundaries))
    with Runtime(path, ubatch=UBATCH, rig=rig) as split:
        logits = split.logits(PROMPT)
        tokens = list(split.generate(PROMPT[:5], 64, GREEDY))
        calls = [link.client.counters.calls for link in split.shards.links]
        transports = {link.client.transport for link in split.shards.links}
    assert relative_error(logits, want_logits) <= BOUNDS["f32"]
    assert tokens == want_tokens
    assert calls == [calls[0]] * len(boundaries) and calls[0] >= 64
    assert transports == {"shared"}                     # shards on this host: a slot of a shared arena


def test_a_context_goes_on_through_the_shards(model):
    """Their caches keep no snapshots: a context's tokens are prefilled again, and the tokens
    after it are the all-local ones."""
    path, _, want_tokens = model
    with Runtime(path, ubatch=UBATCH, rig=RigConfig(splits=(("cpu", 2),))) as split:
        context = split.context(PROMPT[:3])
        assert context.state is None
        assert list(split.generate(PROMPT[3:5], 64, GREEDY, context=context)) == want_tokens


def test_the_socket_transport_gives_the_same(model):
    path, want_logits, want_tokens = model
    with Runtime(path, ubatch=UBATCH, rig=RigConfig(splits=(("cpu", 1), ("cpu", 3)), transport="stream")) as split:
        assert {link.client.transport for link in split.shards.links} == {"stream"}
        assert relative_error(split.logits(PROMPT), want_logits) <= BOUNDS["f32"]
        assert list(split.generate(PROMPT[:5], 64, GREEDY)) == want_tokens


@pytest.mark.parametrize("transport", ["shared", "stream"])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_payload_dtypes_stay_within_their_bounds(model, dtype, transport):
    path, want_logits, _ = model
    rig = RigConfig(splits=(("cpu", 2),), payload_dtype=dtype, transport=transport)
    with Runtime(path, ubatch=UBATCH, rig=rig) as split:
        assert relative_error(split.logits(PROMPT), want_logits) <= BOUNDS[dtype]


def test_shards_with_expert_daemons(model):
    """The parent's own layers send their cold experts to a daemon; the shard runs the rest."""
    path, want_logits, want_tokens = model
    rig = RigConfig(daemons=("cpu",), hot=2, splits=(("cpu", 2),), require_daemons=True)
    with Runtime(path, ubatch=UBATCH, rig=rig) as split:
        logits = split.logits(PROMPT)
        tokens = list(split.generate(PROMPT[:5], 64, GREEDY))
        stats = split.moe_stats()
    assert stats.remote_pairs > 0
    assert relative_error(logits, want_logits) <= BOUNDS["f32"]
    assert tokens == want_tokens


def test_a_shard_killed_mid_request_fails_it_and_the_next_request_is_right(model):
    path, want_logits, want_tokens = model
    with Runtime(path, ubatch=UBATCH, rig=RigConfig(splits=(("cpu", 1), ("cpu", 3)))) as split:
        link = split.shards.links[1]
        tokens = []
        with pytest.raises(ShardFailed, match=r"layer shard s1 cpu layers 3-3 died: the request fails"):
            for token in split.generate(PROMPT[:5], 64, GREEDY):
                tokens.append(token)
                if len(tokens) == 4:
                    link.local.process.send_signal(signal.SIGKILL)
        assert tokens == want_tokens[:len(tokens)]
        assert relative_error(split.logits(PROMPT), want_logits) <= BOUNDS["f32"]    # restarted, prefilled again
        assert list(split.generate(PROMPT[:5], 64, GREEDY)) == want_tokens
        assert (link.restarts, link.times_down) == (1, 1)


@contextlib.contextmanager
def shard_by_hand(path, folder, layers: str, ctx: int, *flags: str):
    """`moerun daemon --layers A:B --ctx N [flags]` on an endpoint of its own; yields the endpoint."""
    endpoint = f"ipc://{folder}/shard.sock"
    process = subprocess.Popen([sys.executable, "-m", "moerun", "daemon", "-m", str(path), "--layers", layers,
                                "--ctx", str(ctx), "--listen", endpoint, *flags], stdin=subprocess.DEVNULL)
    try:
        wait_for_socket(folder / "shard.sock", process)
        yield endpoint
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


def test_a_shard_started_by_hand(model, tmp_path):
    """`moerun daemon --layers 2:4` on an endpoint the parent connects to; one with other
    layers or a shorter context is refused with the flag that would fit."""
    path, want_logits, _ = model
    with shard_by_hand(path, tmp_path, "2:4", 512) as endpoint:
        with Runtime(path, ctx=512, ubatch=UBATCH, rig=RigConfig(splits=((endpoint, 2),))) as split:
            assert relative_error(split.logits(PROMPT), want_logits) <= BOUNDS["f32"]
        with pytest.raises(RigError, match="runs layers \\[2, 4\\], not 3:4 \\(start it with --layers 3:4\\)"):
            Runtime(path, ctx=512, rig=RigConfig(splits=((endpoint, 3),)))
        with pytest.raises(RigError, match="holds 512 positions, the parent needs 1024"):
            Runtime(path, ctx=1024, rig=RigConfig(splits=((endpoint, 2),)))


def test_a_shard_refuses_a_step_that_does_not_continue_its_sequence(model, tmp_path):
    path, _, _ = model
    with shard_by_hand(path, tmp_path, "1:4", 64) as endpoint, DaemonClient(endpoint, connect_timeout_s=60) as client:
        info = client.hello(client_fingerprint(path))
        x = np.ones((3, info["hidden"]), np.float32)
        assert client.forward(1, 0, x, "f32", 30).shape == x.shape
        with pytest.raises(DaemonError, match="sequence 1 at position 5 does not continue .* position 3"):
            client.forward(1, 5, x, "f32", 30)
        with pytest.raises(DaemonError, match="do not fit this shard's context of 64"):
            client.forward(1, 3, np.ones((62, info["hidden"]), np.float32), "f32", 30)
        with pytest.raises(DaemonError, match="takes no ASSIGN"):
            client.assign({1: [0]})


def test_split_flags_are_checked():
    with pytest.raises(ConfigError, match="ascending"):
        RigConfig(splits=(("cpu", 3), ("cpu", 2)))
    with pytest.raises(ConfigError, match="LAYER >= 1"):
        RigConfig(splits=(("cpu", 0),))
    with pytest.raises(ConfigError, match="expected SPEC@LAYER with SPEC cpu"):
        RigConfig(splits=(("gpu7", 2),))


def test_a_boundary_past_the_model_is_refused(model):
    path, _, _ = model
    with pytest.raises(RigError, match=r"--split cpu@4: the model has layers 0\.\.3, so a shard starts at a layer "
                                       r"from 1 to 3"):
        Runtime(path, rig=RigConfig(splits=(("cpu", 4),)))


def client_fingerprint(path) -> str:
    from moerun.gguf.reader import GGUFFile
    with GGUFFile(path) as gguf:
        return gguf.fingerprint()


def test_the_stats_show_each_shard(model):
    from moerun.engine.report import stats_document, stats_table
    from moerun.engine.runtime import RunStats
    path, _, _ = model
    with Runtime(path, ubatch=UBATCH, rig=RigConfig(splits=(("cpu", 2),))) as split:
        run = RunStats()
        list(split.generate(PROMPT[:5], 8, GREEDY, stats=run))
        doc = stats_document(split, run)
    shard, = doc["daemons"]
    assert shard["name"] == "s0 cpu layers 2-3" and shard["layers"] == [2, 4] and shard["state"] == "up"
    assert shard["calls"] == 8 and shard["parent_wait_ms"] > shard["daemon_compute_ms"] > 0      # prefill + 7 steps
    assert "s0 cpu layers 2-3" in stats_table(doc, width=160)


def test_split_auto_needs_gpus_and_stands_alone(model):
    path, _, _ = model
    with pytest.raises(RigError, match="--split auto spreads the layers over this host's GPUs"):
        Runtime(path, rig=RigConfig(split_auto=True))
    with pytest.raises(ConfigError, match="give it alone"):
        RigConfig(split_auto=True, splits=(("cpu", 2),))


def test_metrics_show_each_shard(model):
    from moerun.server.metrics import ServerMetrics
    path, _, _ = model
    with Runtime(path, ubatch=UBATCH, rig=RigConfig(splits=(("cpu", 2),))) as split:
        split.logits(PROMPT)
        metrics = ServerMetrics()
        metrics.watch(split)
        lines = metrics.render().decode().splitlines()
    labels = '{layers="2-3",shard="s0",spec="cpu"}'
    steps = [line for line in lines if line.startswith(f"moerun_shard_steps_total{labels} ")]
    assert steps and float(steps[0].split()[-1]) == -(-len(PROMPT) // UBATCH)      # one step a prefill chunk
    assert f"moerun_shard_up{labels} 1.0" in lines and f"moerun_shard_failures_total{labels} 0.0" in lines


def test_a_shard_that_died_between_requests_is_restarted_before_the_next(model):
    path, want_logits, _ = model
    with Runtime(path, ubatch=UBATCH, rig=RigConfig(splits=(("cpu", 2),))) as split:
        split.logits(PROMPT[:3])
        link = split.shards.links[0]
        link.local.process.kill()
        link.local.process.wait()
        assert relative_error(split.logits(PROMPT), want_logits) <= BOUNDS["f32"]
        assert (link.times_down, link.restarts) == (1, 1)


def test_an_expert_daemon_refuses_a_forward(model, tmp_path):
    from tests.support.daemon_fixtures import running_daemons
    path, _, _ = model
    with running_daemons(path, 1, tmp_path) as endpoints, DaemonClient(endpoints[0], connect_timeout_s=60) as client:
        info = client.hello(client_fingerprint(path))
        with pytest.raises(DaemonError, match="this daemon serves experts; a layer shard is a daemon started with"):
            client.forward(1, 0, np.ones((1, info["hidden"]), np.float32), "f32", 30)


def test_serve_with_shards_refuses_prefix_snapshots_asked_for(moerun, model):
    path, _, _ = model
    result = moerun("serve", "-m", path, "--port", "0", "--split", "cpu@2", "--prefix-cache-slots", "2")
    assert result.exit_code == 1
    assert "--split: prefix snapshots do not reach the layer shards' KV caches yet" in result.stderr


def test_the_hidden_states_payload_dtype_by_default_and_when_asked():
    assert RigConfig(splits=(("cpu", 2),)).shard_payload_dtype("cpu") == "f32"
    gpu = RigConfig(device="cuda:0", splits=(("cuda:1", 2),))
    assert gpu.shard_payload_dtype("cuda:1") == "bf16"                   # GPU to GPU
    assert gpu.shard_payload_dtype("cpu") == "f32"
    assert gpu.shard_payload_dtype("tcp://box:7071") == "f32"            # what runs there is not known
    assert RigConfig(device="cuda:0", payload_dtype="f16").shard_payload_dtype("cuda:1") == "f16"
    assert gpu.expert_payload_dtype == "f32"


def test_a_shard_with_expert_daemons_of_its_own(model, tmp_path):
    """`moerun daemon --layers 2:4 --daemon cpu --hot 1`: the shard keeps one expert of each of
    its layers and sends the others' pairs to its own daemon, as a parent does."""
    path, want_logits, want_tokens = model
    with shard_by_hand(path, tmp_path, "2:4", 512, "--daemon", "cpu", "--hot", "1") as endpoint:
        with Runtime(path, ctx=512, ubatch=UBATCH, rig=RigConfig(splits=((endpoint, 2),))) as split:
            assert relative_error(split.logits(PROMPT), want_logits) <= BOUNDS["f32"]
            assert list(split.generate(PROMPT[:5], 16, GREEDY)) == want_tokens[:16]
            stats = split.shards.links[0].client.stats()
    assert stats["expert_daemons"] == 1 and stats["remote_pairs"] > 0


def test_expert_daemon_flags_are_a_shards(moerun, model):
    path, _, _ = model
    result = moerun("daemon", "-m", path, "--listen", "ipc:///tmp/never.sock", "--daemon", "cpu")
    assert result.exit_code == 2 and "--daemon and --hot are a layer shard's (--layers A:B)" in result.stderr


def test_a_split_table_gives_a_spawned_shard_its_own_expert_daemons(model, tmp_path):
    from moerun.config import load_config_file
    path, want_logits, _ = model
    config = tmp_path / "rig.toml"
    config.write_text('[[split]]\ndevice = "cpu"\nlayer = 2\ndaemons = ["cpu"]\nhot = 1\n')
    entries = load_config_file(config)["split_entries"]
    rig = RigConfig(splits=(("cpu", 2),), split_entries=entries)
    with Runtime(path, ubatch=UBATCH, rig=rig) as split:
        assert relative_error(split.logits(PROMPT), want_logits) <= BOUNDS["f32"]
        stats = split.shards.links[0].client.stats()
    assert stats["expert_daemons"] == 1 and stats["remote_pairs"] > 0
