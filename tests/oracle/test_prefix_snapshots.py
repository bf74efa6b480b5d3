"""Prefix snapshots: a request that resumes from a snapshot of its prompt's prefix gives the
logits and greedy tokens of a full prefill (a hybrid model, whose recurrent states a snapshot
must carry, and an attention-only one), and the cache keeps what it should."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from moerun.engine.prefix_cache import PrefixCache
from moerun.engine.runtime import RunStats, Runtime
from moerun.engine.sampler import SamplingParams
from tests.support.hf_models import tiny_model
from tests.support.to_gguf import write_gguf

RNG = np.random.default_rng(21)
SYSTEM = RNG.integers(0, 320, 23).tolist()          # a prefix many requests share
QUESTION, FOLLOW_UP = RNG.integers(0, 320, 9).tolist(), RNG.integers(0, 320, 6).tolist()
GREEDY = SamplingParams(temperature=0.0)
BOUND = 1e-5             # max |resumed - full| / max |full| of the logits after a prompt


@pytest.fixture(scope="module", params=["qwen35moe", "qwen3moe"])
def model_path(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return write_gguf(tiny_model(request.param, seed=2), folder / "model.gguf", "F32")


def answer(runtime: Runtime, prompt: list[int], n: int = 8) -> tuple[list[int], RunStats]:
    stats = RunStats()
    return list(runtime.generate(prompt, n, GREEDY, stats=stats)), stats


def prompt_logits(path, prompt: list[int]) -> np.ndarray:
    """The logits after a full prefill of `prompt`, through a fresh runtime's snapshot of it."""
    cache = PrefixCache(slots=1, interval=0)
    with Runtime(path, ubatch=5, prefix_cache=cache) as runtime:
        answer(runtime, prompt, 0)
    return cache.longest(prompt).logits


def test_a_shared_prefix_resumes_with_the_full_prefill_results(model_path):
    cache = PrefixCache(slots=4, interval=8)
    first, second = SYSTEM + QUESTION, SYSTEM + FOLLOW_UP
    with Runtime(model_path, ubatch=5, prefix_cache=cache) as runtime:
        answer(runtime, first)
        tokens, stats = answer(runtime, second)
    assert stats.restored_tokens == 16              # the interval's last snapshot inside SYSTEM (23 tokens)
    with Runtime(model_path, ubatch=5) as fresh:
        assert tokens == answer(fresh, second)[0]
    resumed, full = cache.longest(second).logits, prompt_logits(model_path, second)
    assert np.max(np.abs(resumed - full)) / np.max(np.abs(full)) <= BOUND


def test_the_next_chat_turn_resumes_after_the_answer(model_path):
    cache = PrefixCache(slots=4, interval=0)
    with Runtime(model_path, ubatch=5, prefix_cache=cache) as runtime:
        reply, _ = answer(runtime, SYSTEM + QUESTION)
        turn = SYSTEM + QUESTION + reply + FOLLOW_UP
        tokens, stats = answer(runtime, turn)
    assert stats.restored_tokens == len(SYSTEM + QUESTION + reply) - 1     # the last token was never run
    with Runtime(model_path, ubatch=5) as fresh:
        assert tokens == answer(fresh, turn)[0]


def test_a_repeated_prompt_prefills_nothing(model_path):
    cache = PrefixCache(slots=2, interval=0)
    with Runtime(model_path, prefix_cache=cache) as runtime:
        first, _ = answer(runtime, SYSTEM, 0)
        tokens, stats = answer(runtime, SYSTEM)
        again, stats_again = answer(runtime, SYSTEM)
    assert stats.restored_tokens == len(SYSTEM) and tokens == again and stats_again.restored_tokens == len(SYSTEM)
    assert cache.stats.hits == 2 and cache.stats.restored_tokens == 2 * len(SYSTEM)


def test_least_recently_used_snapshots_go_first(model_path):
    cache = PrefixCache(slots=2, interval=0)
    prompts = [SYSTEM[:10], QUESTION, FOLLOW_UP]
    with Runtime(model_path, prefix_cache=cache) as runtime:
        for prompt in prompts:
            answer(runtime, prompt, 0)
    assert len(cache) == 2 and cache.stats.evictions == 1
    assert cache.longest(SYSTEM[:10]) is None
    assert cache.longest(QUESTION) is not None and cache.longest(FOLLOW_UP + [1]) is not None
    assert cache.nbytes > 0


def test_a_failed_step_takes_no_snapshot(model_path, monkeypatch):
    cache = PrefixCache(slots=4, interval=0)
    with Runtime(model_path, prefix_cache=cache) as runtime:
        answer(runtime, SYSTEM, 0)
        taken = cache.stats.snapshots
        monkeypatch.setattr(runtime.model, "forward", lambda *args, **kwargs: (_ for _ in ()).throw(OSError("boom")))
        with pytest.raises(OSError):
            answer(runtime, SYSTEM + QUESTION)
    assert cache.stats.snapshots == taken


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="at least one slot"):
        PrefixCache(slots=0, interval=0)
    with pytest.raises(ValueError, match="interval"):
        PrefixCache(slots=1, interval=-1)


def disk_cache(folder, budget: int = 1 << 30) -> PrefixCache:
    return PrefixCache(slots=4, interval=0, folder=folder, disk_budget=budget)


def test_snapshots_on_disk_outlive_the_runtime(model_path, tmp_path):
    prompt = SYSTEM + QUESTION
    with Runtime(model_path, prefix_cache=disk_cache(tmp_path)) as runtime:
        tokens, _ = answer(runtime, prompt)
    cache, turn = disk_cache(tmp_path), prompt + tokens + FOLLOW_UP
    with Runtime(model_path, prefix_cache=cache) as restarted:
        again, stats = answer(restarted, turn)
        assert stats.restored_tokens == len(prompt + tokens) - 1 and cache.stats.disk_hits == 1
    with Runtime(model_path) as fresh:
        assert again == answer(fresh, turn)[0]
    full = prompt_logits(model_path, prompt)
    resumed = disk_cache(tmp_path)
    with Runtime(model_path, prefix_cache=resumed):
        from_disk = resumed.longest(prompt).logits
    assert np.max(np.abs(from_disk - full)) / np.max(np.abs(full)) <= BOUND


def snapshot_files(folder) -> list:
    return sorted(folder.glob("*/*.snap"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "version", "foreign"])
def test_a_damaged_or_foreign_file_is_never_loaded(model_path, tmp_path, damage, caplog):
    with Runtime(model_path, prefix_cache=disk_cache(tmp_path)) as runtime:
        answer(runtime, SYSTEM, 0)
    path, = snapshot_files(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "version":
        data[12] = 99
    path.write_bytes(bytes(data))
    if damage == "foreign":                     # another model's folder: never even looked at
        other = tmp_path / ("0" * 32)
        other.mkdir()
        path.rename(other / path.name)
    cache = disk_cache(tmp_path)
    with Runtime(model_path, prefix_cache=cache) as runtime:
        _, stats = answer(runtime, SYSTEM, 0)
    assert stats.restored_tokens == 0 and cache.stats.disk_hits == 0
    if damage != "foreign":
        assert "skipped and deleted" in caplog.text


def test_a_file_is_used_while_its_digest_is_checked_and_refused_when_it_fails(model_path, tmp_path, caplog):
    """Every file of a prompt damaged past its header: each is restored and its rest prefilled
    while its check runs, then refused before any snapshot is taken from it or a token goes
    out; the prompt ends up prefilled whole, its answer a fresh runtime's."""
    prefix_cache = PrefixCache(slots=4, interval=8, folder=tmp_path, disk_budget=1 << 30)
    with Runtime(model_path, prefix_cache=prefix_cache) as runtime:
        answer(runtime, SYSTEM, 0)                  # files at 8, 16 and 23 tokens
    files = snapshot_files(tmp_path)
    for path in files:
        data = bytearray(path.read_bytes())
        data[-33] ^= 0xFF                           # the body's last byte: the header still reads
        path.write_bytes(bytes(data))
    cache = PrefixCache(slots=4, interval=8, folder=tmp_path, disk_budget=1 << 30)
    with Runtime(model_path, prefix_cache=cache) as runtime:
        restored, restore = [], runtime.backend.restore_cache
        def counted_restore(state, capacity):
            restored.append(state.length)
            return restore(state, capacity)
        runtime.backend.restore_cache = counted_restore
        tokens, stats = answer(runtime, SYSTEM + FOLLOW_UP)
    with Runtime(model_path) as fresh:
        assert tokens == answer(fresh, SYSTEM + FOLLOW_UP)[0]
    assert len(files) == 3 and restored == [23, 16, 8]          # each used while checked, then refused
    assert stats.restored_tokens == 0 and cache.stats.disk_hits == 0
    assert caplog.text.count("digest does not match") == 3
    again = disk_cache(tmp_path)                    # the files now: written from the whole prefill
    with Runtime(model_path, prefix_cache=again):
        assert again.confirm(snapshot := again.longest(SYSTEM[:16]))
    full = prompt_logits(model_path, SYSTEM[:16])
    assert np.max(np.abs(snapshot.logits - full)) / np.max(np.abs(full)) <= BOUND


def test_the_disk_budget_keeps_the_newest(model_path, tmp_path):
    oldest, older, newest = SYSTEM[:9], QUESTION, SYSTEM[9:18]          # snapshots of one size
    with Runtime(model_path, prefix_cache=disk_cache(tmp_path)) as runtime:
        answer(runtime, oldest, 0)
    one = snapshot_files(tmp_path)[0].stat().st_size
    with Runtime(model_path, prefix_cache=disk_cache(tmp_path, budget=2 * one)) as runtime:
        answer(runtime, older, 0)
        answer(runtime, newest, 0)
    assert len(snapshot_files(tmp_path)) == 2
    cache = disk_cache(tmp_path)
    with Runtime(model_path, prefix_cache=cache):
        assert cache.longest(newest) is not None and cache.longest(older) is not None
        assert cache.longest(oldest) is None


def test_a_failed_write_is_a_warning(model_path, tmp_path, caplog):
    cache = disk_cache(tmp_path)
    with Runtime(model_path, prefix_cache=cache) as runtime:
        store = cache.store
        store.folder.rmdir()
        store.folder.write_text("not a folder")      # every write there fails, as on a full disk
        tokens, _ = answer(runtime, SYSTEM)
    assert len(tokens) == 8 and "not written" in caplog.text and store.files == {}


def test_a_snapshot_still_being_written_is_found(model_path, tmp_path, monkeypatch):
    """Out of RAM (one slot) while its file waits for the writer: the store answers with it."""
    from moerun.engine.snapshot_store import SnapshotStore
    release, write_file = threading.Event(), SnapshotStore._write_file
    def held_write(store, snapshot):
        release.wait(30)
        return write_file(store, snapshot)
    monkeypatch.setattr(SnapshotStore, "_write_file", held_write)
    cache = PrefixCache(slots=1, interval=0, folder=tmp_path, disk_budget=1 << 30)
    with Runtime(model_path, prefix_cache=cache) as runtime:
        answer(runtime, SYSTEM, 0)
        answer(runtime, QUESTION, 0)                  # SYSTEM's snapshot leaves RAM
        _, stats = answer(runtime, SYSTEM + FOLLOW_UP, 0)
        release.set()
    assert stats.restored_tokens == len(SYSTEM) and snapshot_files(tmp_path) != []
    full = prompt_logits(model_path, SYSTEM + FOLLOW_UP)
    assert np.max(np.abs(cache.longest(SYSTEM + FOLLOW_UP).logits - full)) / np.max(np.abs(full)) <= BOUND


def test_a_short_rest_goes_in_captured_steps(model_path, monkeypatch):
    """Where the backend captures steps of up to 8 tokens, a prompt's rest of up to four such
    steps goes in them (a chat's next turn after its snapshot), a longer one in ubatch chunks."""
    with Runtime(model_path, ubatch=512) as runtime:
        monkeypatch.setattr(runtime.backend, "step_tokens", 8)

        def chunks(n_tokens: int, start: int = 0) -> list[int]:
            return [len(chunk) for chunk in runtime._chunks(list(range(n_tokens)), start)]

        assert chunks(20) == [8, 8, 4] and chunks(32) == [8, 8, 8, 8] and chunks(8) == [8]
        assert chunks(33) == [33] and chunks(1000, 980) == [8, 8, 4]
        # with expert daemons up (an executor key of theirs) only one-token steps are captured
        monkeypatch.setattr(runtime.model.executor, "graph_key", lambda: ((0, 1),))
        assert runtime.model.step_tokens == 1 and chunks(3) == [1, 1, 1] and chunks(5) == [5]
        monkeypatch.setattr(runtime.model.executor, "graph_key", lambda: None)     # a daemon down: none
        assert runtime.model.step_tokens == 0 and chunks(3) == [3]
