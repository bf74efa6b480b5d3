"""`moerun profile`, `moerun plan`, `--placement auto` and the KV pool, end to end."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from moerun.backends.kv_types import KVTypes
from moerun.engine.runtime import RequestError, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.reader import GGUFFile
from moerun.models import load_spec
from moerun.moe.hotness import HotnessError, read_hotness
from moerun.moe.placement import load_placement
from moerun.moe.planner import model_sizes
from moerun.rig.settings import RigConfig
from moerun.writers.synthetic import SyntheticConfig, write_synthetic_model

CONFIG = SyntheticConfig(name="skewed-test", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32,
                         n_experts=16, n_experts_used=2, expert_ff=64, vocab_size=400, router_skew=3.0)
PROMPTS = "the parent sends every daemon its work\nexperts are a quiet crowd\n\nevery token picks a few\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("planning")
    corpus = "the parent sends every daemon its work first, and experts answer. " * 20
    return write_synthetic_model(folder / "skewed.gguf", CONFIG, corpus, bigram_head=False)


@pytest.fixture(scope="module")
def hotness(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hotness")
    (folder / "prompts.txt").write_text(PROMPTS)
    from click.testing import CliRunner

    from moerun.cli import main
    out = folder / "hot.csv"
    result = CliRunner().invoke(main, ["profile", "-m", str(model), "-f", str(folder / "prompts.txt"), "-o", str(out),
                                       "-n", "5"])
    assert result.exit_code == 0, result.output
    return out


def test_profile_counts_every_routed_pair(model, hotness):
    forwarded = 0                      # tokens that went through a forward pass
    with Runtime(model) as runtime:
        for line in filter(str.strip, PROMPTS.splitlines()):
            ids = runtime.tokenizer.encode(line)
            generated = len(list(runtime.generate(ids, 5, SamplingParams(temperature=0.0), runtime.tokenizer.stop_ids)))
            forwarded += len(ids) + (generated - 1 if generated == 5 else generated)
        spec = runtime.spec
    counts = read_hotness(hotness, spec)
    assert counts.sum() == forwarded * spec.n_experts_used * spec.n_layers
    rows = list(csv.reader(hotness.read_text().splitlines()))
    assert rows[0] == ["layer", "expert", "count"] and len(rows) == 1 + spec.n_layers * spec.n_experts
    top = np.sort(counts, axis=1)[:, ::-1]
    assert (top[:, :4].sum(axis=1) > 0.5 * counts.sum(axis=1)).all(), "the skewed router should concentrate"


@pytest.mark.parametrize("content, phrase", [("", "not a routing-count file"), ("layer,expert,count\n1,2\n", ":2:"),
                                             ("layer,expert,count\n0,99,5\n", "does not fit")])
def test_bad_hotness_files(model, tmp_path, content, phrase):
    path = tmp_path / "h.csv"
    path.write_text(content)
    with GGUFFile(model) as gguf:
        spec = load_spec(gguf)
    with pytest.raises(HotnessError, match=phrase):
        read_hotness(path, spec)


def parent_bytes_for(model, experts_per_layer: int, ctx: int) -> int:
    with GGUFFile(model) as gguf:
        sizes = model_sizes(gguf, load_spec(gguf))
    return (sizes.non_expert_bytes + sizes.kv_token_bytes(KVTypes("f32", "f32")) * ctx      # a CPU parent's cache
            + experts_per_layer * max(sizes.expert_bytes) * sum(sizes.moe_layers))


@pytest.mark.parametrize("parent, cache", [("cpu", "f32"), ("cuda:0", "f16")])
def test_plan_reserves_the_parents_own_kv_cache_type(model, tmp_path, moerun, parent, cache):
    """The KV cache each backend keeps by default: f32 on the CPU, f16 on a GPU (--kv-dtype)."""
    result = moerun("plan", "-m", model, "--device", f"{parent}=1GiB", "--ctx", "1024", "-o", tmp_path / "p.json")
    assert result.exit_code == 0, result.output
    assert f"KV cache: 1024 tokens at {cache} " in result.stdout


def test_plan_writes_a_placement_that_runs(model, hotness, tmp_path, moerun):
    out = tmp_path / "placement.json"
    size = parent_bytes_for(model, 4, 1024)
    result = moerun("plan", "-m", model, "--device", f"cpu={size}", "--cpu", "1GiB", "--ctx", "1024",
                    "--hotness", hotness, "--safety", "0", "--workspace", "0", "-o", out)
    assert result.exit_code == 0, result.output
    assert "traffic" in result.stdout and "rule: full context" in result.stdout
    with GGUFFile(model) as gguf:
        spec, fingerprint = load_spec(gguf), gguf.fingerprint()
    placement = load_placement(out, spec, ["cpu"], fingerprint)
    counts = read_hotness(hotness, spec)
    on_parent = {(layer, e) for layer, homes in placement.homes.items() for e in np.flatnonzero(homes == -1)}
    assert len(on_parent) == 4 * spec.n_layers
    # the parent keeps each layer's K busiest (the floor), then the busiest of the rest overall
    floor = {(layer, e) for layer in placement.homes for e in np.argsort(-counts[layer], kind="stable")[:2]}
    rest = sorted(((counts[layer, e], layer, e) for layer in placement.homes for e in range(spec.n_experts)
                   if (layer, e) not in floor), reverse=True)
    best = sum(counts[k] for k in floor) + sum(c for c, _, _ in rest[: len(on_parent) - len(floor)])
    assert floor <= on_parent and sum(counts[k] for k in on_parent) == best
    assert json.loads(out.read_text())["daemons"] == ["cpu"]
    ids = list(range(1, 30))
    with Runtime(model) as local:
        expected = local.logits(ids)
    with Runtime(model, rig=RigConfig(daemons=("cpu",), placement=str(out))) as runtime:
        got = runtime.logits(ids)
    assert np.max(np.abs(got - expected)) <= 1e-5 * np.max(np.abs(expected))


@pytest.mark.parametrize("args, phrase", [
    (["--device", "cpu=1MiB", "--ctx", "1024"], "--ctx"),
    (["--device", "cpu", "--ctx", "1024"], "DEVICE=SIZE"),
    (["--device", "cpu=lots", "--ctx", "1024"], "cannot read size"),
    (["--device", "cpu=1GiB", "--daemon", "cuda:1", "--ctx", "1024"], "DEVICE=SIZE"),
])
def test_plan_bad_arguments(model, tmp_path, moerun, args, phrase):
    result = moerun("plan", "-m", model, *args, "-o", tmp_path / "p.json")
    assert result.exit_code != 0 and phrase in result.output and "Traceback" not in result.output
    assert not (tmp_path / "p.json").exists()


def test_placement_auto_plans_from_free_memory(model):
    with Runtime(model, rig=RigConfig(daemons=("cpu",), placement="auto")) as runtime:
        homes = runtime.rig.placement.homes
        assert set(homes) == {0, 1} and all(len(row) == CONFIG.n_experts for row in homes.values())
        assert list(runtime.generate([5, 6, 7], 4, SamplingParams(temperature=0.0)))


def test_kv_pool_overflow_names_the_flag(model):
    with Runtime(model, ctx=64, kv_pool=8) as runtime:
        with pytest.raises(RequestError, match="--kv-pool"):
            runtime.logits(list(range(1, 12)))
        with pytest.raises(RequestError, match="--kv-pool"):
            list(runtime.generate([1, 2, 3], 20, SamplingParams(temperature=0.0)))
        assert len(list(runtime.generate([1, 2, 3], 5, SamplingParams(temperature=0.0)))) == 5


def test_kv_cache_grows_in_pages(model):
    with Runtime(model, ctx=2048) as runtime:
        from moerun.backends.numpy_backend import PAGE_TOKENS, PagedKVCache
        cache = PagedKVCache(runtime.spec, runtime.ctx)
        runtime.model.forward(np.arange(1, 10), cache, all_logits=False)
        assert cache._k[0].shape[0] == PAGE_TOKENS
        runtime.model.forward(np.arange(1, PAGE_TOKENS + 10) % 300 + 1, cache, all_logits=False)
        assert cache._k[0].shape[0] == 2 * PAGE_TOKENS


def test_plan_reserves_a_gpu_parents_expert_cache_and_streaming_buffers(model, tmp_path, moerun):
    """A GPU parent with a CPU daemon: --expert-cache is kept free of experts; prefill streaming
    (the default) reserves its buffers, which on this two-layer model leave no room: the error
    names the way out."""
    with GGUFFile(model) as gguf:
        sizes = model_sizes(gguf, load_spec(gguf))
    expert = max(sizes.expert_bytes)
    kv = sizes.kv_token_bytes(KVTypes("f16", "f16")) * 1024
    parent = sizes.non_expert_bytes + kv + 2 * 12 * expert   # 12 of 16 a layer

    def plan(*flags):
        out = tmp_path / "p.json"
        result = moerun("plan", "-m", model, "--device", f"cuda:0={parent}", "--cpu", "1GiB", "--ctx", "1024",
                        "--safety", "0", "--workspace", "0", *flags, "-o", out)
        on_parent = sum(homes.count(-1) for homes in json.loads(out.read_text())["layers"].values()) \
            if result.exit_code == 0 else None
        return result, on_parent

    assert plan("--stream-threshold", "off")[1] == 24
    assert plan("--stream-threshold", "off", "--expert-cache", str(4 * expert))[1] == 20
    result, _ = plan()
    assert result.exit_code != 0 and "--stream-threshold off" in result.output and "Traceback" not in result.output
