"""Speculative decoding (engine/speculative.py): verifying drafts never changes the output.
Greedy, the tokens of plain decoding on every architecture, whether the drafts are right, wrong
or cut short by a stop token, the token limit or the context; sampling, the distribution of
plain sampling (chi-squared tests of the sampler's accept-or-redraw rule, and of the first two
tokens on a tiny model); the n-gram drafter and the gate on their own."""
from __future__ import annotations

import numpy as np
import pytest

import moerun.engine.runtime as runtime_module
from moerun.engine.prefix_cache import PrefixCache
from moerun.engine.runtime import RequestError, RunStats, Runtime
from moerun.engine.sampler import Sampler, SamplingParams
from moerun.engine.speculative import FIRST_PAUSE, REMEASURE, NgramDrafter, SpecGate, SpecParams
from moerun.errors import UsageError
from tests.support.hf_models import ARCHS, HYBRID_ARCHS, tiny_model
from tests.support.to_gguf import write_gguf

GREEDY = SamplingParams(temperature=0.0)
FORCED = SpecParams("ngram", draft_max=6, gated=False)       # a verify at every step that has drafts
NEW_TOKENS = 256


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    return write_gguf(tiny_model(request.param), tmp_path_factory.mktemp("spec") / f"{request.param}.gguf", "Q8_0")


def prompt_of(runtime: Runtime, n: int = 12) -> list[int]:
    return np.random.default_rng(3).integers(0, runtime.spec.vocab, n).tolist()


class ScriptedDrafter:
    """Drafts what plain decoding gave after the prompt, every `wrong`-th draft with one token
    changed: verifies that accept every draft, part of one, or none."""

    def __init__(self, prompt: list[int], plain: list[int], vocab: int, wrong: int = 3):
        self.sequence, self.start, self.vocab, self.wrong, self.calls = prompt + plain, len(prompt), vocab, wrong, 0

    def draft(self, history, most):
        self.calls += 1
        drafts = self.sequence[len(history):len(history) + most]
        if drafts and self.calls % self.wrong == 0:
            at = self.calls % len(drafts)
            drafts[at] = (drafts[at] + 1) % self.vocab
        return drafts


@pytest.fixture
def scripted(monkeypatch):
    """Runtime.generate's drafter replaced by ScriptedDrafter over (prompt, plain tokens)."""
    def use(prompt, plain, vocab, wrong=3):
        monkeypatch.setattr(runtime_module, "NgramDrafter", lambda: ScriptedDrafter(prompt, plain, vocab, wrong))
    return use


def test_greedy_speculation_gives_the_plain_tokens(model, scripted):
    with Runtime(model, ubatch=16) as runtime:
        prompt = prompt_of(runtime)
        plain = list(runtime.generate(prompt, NEW_TOKENS, GREEDY))
        ngram_stats = RunStats()
        ngram = list(runtime.generate(prompt, NEW_TOKENS, GREEDY, stats=ngram_stats, speculation=FORCED))
        scripted(prompt, plain, runtime.spec.vocab)
        stats = RunStats()
        drafted = list(runtime.generate(prompt, NEW_TOKENS, GREEDY, stats=stats, speculation=FORCED))
    assert ngram == plain and drafted == plain
    assert ngram_stats.speculation.verify_steps > 0
    spec = stats.speculation
    assert 0 < spec.accepted_tokens < spec.drafted_tokens, "drafts accepted, and drafts rejected"
    assert stats.decode_tokens == NEW_TOKENS - 1 and stats.decode_steps < NEW_TOKENS // 2


@pytest.mark.parametrize("limit", ["stop", "length", "context"])
def test_drafts_past_a_stop_the_token_limit_or_the_context_are_not_taken(model, scripted, limit):
    ctx = 12 + 23 if limit == "context" else None
    with Runtime(model, ubatch=16, ctx=ctx) as runtime:
        prompt = prompt_of(runtime)
        most = 7 if limit == "length" else 40
        first = list(runtime.generate(prompt, 40, GREEDY))
        new = next(i for i in range(5, 40) if first[i] not in first[:i])        # a token not generated before
        stop_ids = frozenset({first[new]}) if limit == "stop" else frozenset()
        plain_stats, spec_stats = RunStats(), RunStats()
        plain = list(runtime.generate(prompt, most, GREEDY, stop_ids, plain_stats))
        scripted(prompt, first, runtime.spec.vocab, wrong=1000)            # every draft right
        spec = list(runtime.generate(prompt, most, GREEDY, stop_ids, spec_stats,
                                     speculation=SpecParams("ngram", draft_max=16, gated=False)))
        after = list(runtime.generate(prompt, 5, GREEDY))                 # the same runtime, afterwards
    assert spec == plain and plain_stats.finish == spec_stats.finish == limit
    assert spec_stats.speculation.verify_steps > 0
    assert after == first[:5]


def test_sampling_accept_or_redraw_keeps_the_distribution():
    """A drafted token taken with the probability the distribution gives it, else a draw from
    the rest: the draws' frequencies fit the distribution (chi-squared, 5 sigma)."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(50).astype(np.float32) * 2
    sampler = Sampler(SamplingParams(temperature=0.9, top_k=12, top_p=1.0, min_p=0.0, seed=5))
    ids, probs = sampler.candidates(logits, [])
    draws = 40_000
    counts = dict.fromkeys(ids.tolist(), 0)
    for i in range(draws):
        drafted = int(ids[i % 3])                                  # likely and less likely drafts
        token = drafted if sampler.accepts(logits, [], drafted) else sampler(logits, [], excluded={drafted})
        counts[token] += 1
    expected = draws * probs
    chi2 = sum((counts[int(t)] - e) ** 2 / e for t, e in zip(ids, expected))
    dof = len(ids) - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)


class SiblingDrafter(NgramDrafter):
    """For the token after x1, the given drafts as siblings: a tree of one level."""

    def __init__(self, drafts):
        super().__init__()
        self.drafts = drafts

    def tree(self, history, most, branches):
        return self.drafts[history[-1]], [-1] * len(self.drafts[history[-1]])

    def draft(self, history, most):
        return self.drafts[history[-1]][:1]


@pytest.mark.parametrize("siblings", [1, 2], ids=["chain", "tree"])
def test_the_first_two_sampled_tokens_keep_their_distribution(monkeypatch, tmp_path, siblings):
    """On a tiny model: the joint distribution of the first two tokens (the second a verified
    draft: taken or redrawn; with a tree, the two likeliest tried in turn) against
    p(x1) · p(x2 | x1) from the model's logits."""
    path = write_gguf(tiny_model("qwen3moe"), tmp_path / "m.gguf", "Q8_0")
    sampling = SamplingParams(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
    with Runtime(path, ubatch=16) as runtime:
        prompt = prompt_of(runtime, 6)
        first_ids, first_probs = Sampler(sampling).candidates(runtime.logits(prompt)[-1], prompt)
        second = {int(x1): Sampler(sampling).candidates(runtime.logits([*prompt, int(x1)])[-1], [*prompt, int(x1)])
                  for x1 in first_ids}
        drafted = {x1: [int(t) for t in ids[:siblings]] for x1, (ids, _) in second.items()}   # the likeliest
        monkeypatch.setattr(runtime, "_drafter", lambda params: SiblingDrafter(drafted))
        counts: dict[tuple[int, int], int] = {}
        runs = 1500
        for seed in range(runs):
            pair = tuple(runtime.generate(prompt, 2, SamplingParams(**{**sampling.__dict__, "seed": seed}),
                                          speculation=SpecParams("ngram", gated=False, branches=2)))
            counts[pair] = counts.get(pair, 0) + 1
    chi2, cells = 0.0, 0
    for x1, p1 in zip(first_ids, first_probs):
        ids, probs = second[int(x1)]
        for x2, p2 in zip(ids, probs):
            expected = runs * p1 * p2
            chi2 += (counts.get((int(x1), int(x2)), 0) - expected) ** 2 / expected
            cells += 1
    support = {(int(a), int(b)) for a in first_ids for b in second[int(a)][0]}
    assert sum(counts.values()) == runs and set(counts) <= support
    dof = cells - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)


def test_the_ngram_drafter_proposes_what_followed_the_longest_match():
    drafter = NgramDrafter()
    history = [5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 6, 7]
    assert drafter.draft(history, 3) == [3, 6, 7]          # (6, 7) last followed by 3
    history += [3]
    assert drafter.draft(history, 4) == [6, 7, 3]           # (6, 7, 3) followed by 6, 7, 3: the sequence up to its end
    assert drafter.draft([1, 2, 3], 4) == []                # nothing seen twice
    assert NgramDrafter().draft([4, 4, 4, 4], 2) == [4]


def test_the_gate_pauses_drafting_while_verifies_lose_and_measures_again():
    gate = SpecGate(SpecParams("ngram", draft_max=8))
    assert gate.room() == 0                                           # a plain step first, to measure
    gate.plain_step(0.010)
    assert gate.room() == 8                                           # no verify measured: --draft-max
    gate.verify_step(drafted=8, accepted=0, seconds=0.030)            # one token in 30 ms: slower than plain
    assert [gate.room() for _ in range(FIRST_PAUSE)] == [0] * FIRST_PAUSE
    assert gate.room() > 0 and gate.stats.paused_steps == FIRST_PAUSE
    gate.verify_step(drafted=8, accepted=0, seconds=0.030)
    assert sum(gate.room() == 0 for _ in range(4 * FIRST_PAUSE)) == 2 * FIRST_PAUSE    # the pause doubled
    gate.verify_step(drafted=8, accepted=5, seconds=0.015)            # six tokens in 15 ms: it wins
    assert gate.room() > 0
    for _ in range(REMEASURE):
        gate.verify_step(drafted=8, accepted=5, seconds=0.015)
    assert gate.room() == 0                                           # a plain step again, to measure
    gate.plain_step(0.010)
    assert gate.room() > 0
    ungated = SpecGate(SpecParams("ngram", draft_max=8, gated=False))
    ungated.plain_step(0.010)
    ungated.verify_step(drafted=8, accepted=0, seconds=0.030)
    assert ungated.room() == 8


@pytest.mark.parametrize(("accepted", "rejected", "best"), [(19.0, 1.0, 8), (3.0, 7.0, 1)])
def test_the_gate_drafts_the_length_that_yields_the_most_tokens_a_second(accepted, rejected, best):
    """Verifies cost 10 ms + 2 ms a token (two widths measured, the rest on their line): at a
    95% acceptance eight drafts (the most) yield the most tokens a second, at 30% one."""
    gate = SpecGate(SpecParams("ngram", draft_max=8), accepted=accepted, rejected=rejected)
    gate.plain_step(0.010)
    gate.width_seconds = {3: 0.014, 9: 0.026}
    assert gate.cost(2) == pytest.approx(0.012) and gate.cost(6) == pytest.approx(0.020)
    assert gate.cost(17) == pytest.approx(0.042)                      # past the widest, at its slope
    assert gate.best_length() == best == gate.room()


def test_a_hybrid_model_rolls_its_deltanet_states_back_to_the_kept_drafts(tmp_path, scripted):
    """qwen35moe: a verify's DeltaNet layers take every verified token in; where drafts are
    rejected their states go back and take the kept ones in again, so the tokens stay plain;
    such a model cannot draft (its cache cannot drop a rejected draft)."""
    path = write_gguf(tiny_model(HYBRID_ARCHS[0]), tmp_path / "hybrid.gguf", "Q8_0")
    with Runtime(path, ubatch=16) as runtime:
        prompt = prompt_of(runtime)
        plain = list(runtime.generate(prompt, 96, GREEDY))
        scripted(prompt, plain, runtime.spec.vocab)
        stats = RunStats()
        spec = list(runtime.generate(prompt, 96, GREEDY, stats=stats, speculation=FORCED))
    assert spec == plain
    assert 0 < stats.speculation.accepted_tokens < stats.speculation.drafted_tokens


def test_a_hybrid_draft_model_goes_back_to_its_saved_states(tmp_path):
    """A qwen35moe draft model (its DeltaNet states kept at the sequence's end before each draft,
    gone back to at the next): drafting for itself nearly every draft is right, for another
    model the tokens stay that model's plain ones."""
    hybrid = write_gguf(tiny_model(HYBRID_ARCHS[0]), tmp_path / "hybrid.gguf", "Q8_0")
    other = write_gguf(tiny_model("qwen3moe"), tmp_path / "target.gguf", "Q8_0")
    for target in (hybrid, other):
        with Runtime(target, ubatch=16, draft_model=hybrid) as runtime:
            prompt = prompt_of(runtime)
            plain = list(runtime.generate(prompt, 64, GREEDY))
            stats = RunStats()
            params = SpecParams("draft", draft_max=4, gated=False, draft_model=str(hybrid))
            assert list(runtime.generate(prompt, 64, GREEDY, stats=stats, speculation=params)) == plain
        spec = stats.speculation
        assert spec.verify_steps > 0
        if target == hybrid:
            assert spec.accepted_tokens >= 0.9 * spec.drafted_tokens


@pytest.mark.parametrize("kwargs", [dict(spec_type="eagle"), dict(draft_max=0), dict(draft_min=5, draft_max=4)])
def test_bad_speculation_settings_are_usage_errors(kwargs):
    with pytest.raises(UsageError):
        SpecParams(**{"spec_type": "ngram", **kwargs})


@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory):
    """A target, a draft of another seed (same vocabulary, rarely right) and one of another vocabulary."""
    folder = tmp_path_factory.mktemp("draft")
    return (write_gguf(tiny_model("qwen3moe"), folder / "target.gguf", "Q8_0"),
            write_gguf(tiny_model("olmoe", seed=1), folder / "draft.gguf", "Q8_0"),
            write_gguf(tiny_model("qwen3moe", vocab_size=352), folder / "other.gguf", "Q8_0"))


def test_a_draft_model_drafts_and_the_output_stays_plain(draft_pair):
    target, draft, _ = draft_pair
    for drafter in (target, draft):            # the target drafting for itself: every draft right
        with Runtime(target, ubatch=16, draft_model=drafter) as runtime:
            prompt = prompt_of(runtime)
            plain = list(runtime.generate(prompt, 64, GREEDY))
            stats = RunStats()
            spec = list(runtime.generate(prompt, 64, GREEDY, stats=stats,
                                         speculation=SpecParams("draft", draft_max=5, gated=False,
                                                                draft_model=str(drafter))))
            auto = list(runtime.generate(prompt, 64, GREEDY, speculation=SpecParams("auto", draft_model=str(drafter))))
            sampled = list(runtime.generate(prompt, 16, SamplingParams(seed=4),
                                            speculation=SpecParams("auto", draft_model=str(drafter))))
        assert spec == plain == auto and len(sampled) == 16
        assert stats.speculation.verify_steps > 0
        if drafter == target:
            assert stats.speculation.accepted_tokens == stats.speculation.drafted_tokens > 0


def test_a_draft_model_of_another_vocabulary_is_refused(draft_pair):
    target, _, other = draft_pair
    with pytest.raises(RequestError, match="vocabulary"):
        Runtime(target, draft_model=other)
    with Runtime(target) as runtime, pytest.raises(RequestError, match="no draft model"):
        list(runtime.generate([1, 2], 2, GREEDY, speculation=SpecParams("draft", draft_model=str(target))))


def test_run_speculates_from_the_command_line(draft_pair, moerun):
    target, draft, _ = draft_pair
    plain = moerun("run", "-m", target, "-p", "ab", "-n", "24", "--temp", "0", "--ignore-eos")
    for flags in (("--spec-type", "ngram", "--no-spec-gate"), ("-md", draft, "--draft-max", "4")):
        result = moerun("run", "-m", target, "-p", "ab", "-n", "24", "--temp", "0", "--ignore-eos", "--stats", *flags)
        assert result.exit_code == 0, result.output
        assert result.stdout == plain.stdout
        assert "spec:" in result.stderr and "verifies" in result.stderr
    refused = moerun("run", "-m", target, "--spec-type", "draft")
    assert refused.exit_code == 1 and "--model-draft" in refused.stderr


def test_a_speculating_answer_leaves_a_snapshot_the_next_turn_resumes_from(model, scripted):
    """The answer's last tokens taken inside a verify: its end snapshot (cache and logits after
    it) is what the next turn resumes from, and gives the tokens of a fresh prefill."""
    with Runtime(model, ubatch=16) as fresh:
        prompt = prompt_of(fresh)
        first = list(fresh.generate(prompt, 40, GREEDY))
        turn = [*prompt, *first[:7], 1, 2, 3]
        expected = list(fresh.generate(turn, 12, GREEDY))
    with Runtime(model, ubatch=16, prefix_cache=PrefixCache(slots=4, interval=0)) as runtime:
        scripted(prompt, first, runtime.spec.vocab, wrong=1000)
        answer = list(runtime.generate(prompt, 7, GREEDY, speculation=SpecParams("ngram", draft_max=16, gated=False)))
        stats = RunStats()
        resumed = list(runtime.generate(turn, 12, GREEDY, stats=stats))
    assert answer == first[:7]
    assert stats.restored_tokens == len(prompt) + 7 and resumed == expected


@pytest.mark.parametrize("arch", [ARCHS[0], HYBRID_ARCHS[0]])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_sequences_decoded_together_speculate_each_as_alone(tmp_path, monkeypatch, arch, temperature):
    """Batched steps (the scheduler): each decoding sequence's share of a step is its last token
    and its drafts; greedy, each gets its plain tokens; sampled, each runs (and stops) as asked."""
    path = write_gguf(tiny_model(arch), tmp_path / f"{arch}.gguf", "Q8_0")
    lengths, new_tokens = (5, 17, 9), (40, 12, 30)
    with Runtime(path, ubatch=32) as runtime:
        rng = np.random.default_rng(9)
        prompts = [rng.integers(0, runtime.spec.vocab, n).tolist() for n in lengths]
        sampling = [SamplingParams(temperature=temperature, seed=3 + b) for b in range(len(prompts))]
        plain = [list(runtime.generate(p, n, GREEDY)) for p, n in zip(prompts, new_tokens)]
        scripts = iter([ScriptedDrafter(p, t, runtime.spec.vocab) for p, t in zip(prompts, plain)])
        monkeypatch.setattr(runtime, "_drafter", lambda params: next(scripts))
        stats = runtime_module.BatchStats()
        together = runtime.generate_batch(prompts, new_tokens, sampling, stats=stats, speculation=FORCED)
    assert [len(t) for t in together] == list(new_tokens)
    if temperature == 0.0:
        assert together == plain
        spec = stats.speculation
        assert spec.verify_steps > 0 and 0 < spec.accepted_tokens < spec.drafted_tokens
        assert stats.decoded_tokens == sum(new_tokens) - len(new_tokens)


def test_speculation_from_a_config_file(draft_pair, moerun, tmp_path):
    """[generate]'s spec keys act as the flags do; a flag on the command line wins."""
    target, draft, _ = draft_pair
    config = tmp_path / "rig.toml"
    config.write_text(f"model = '{target}'\n[generate]\nprompt = 'ab'\nn_predict = 16\ntemp = 0\n"
                      f"spec_type = 'draft'\nmodel_draft = '{draft}'\ndraft_max = 3\nspec_gate = false\nstats = true\n")
    result = moerun("run", "--config", config)
    assert result.exit_code == 0, result.output
    assert "spec:" in result.stderr and "verifies" in result.stderr
    plain = moerun("run", "--config", config, "--spec-type", "none")
    assert plain.exit_code == 0 and plain.stdout == result.stdout and "spec:" not in plain.stderr


def test_ngram_trees_share_the_starts_of_their_branches():
    history = [1, 2, 5, 6, 9, 1, 2, 5, 7, 1, 2, 8, 3, 1, 2]
    tokens, parents = NgramDrafter().tree(history, 8, 3)       # (1, 2) followed by 8 3 .., 5 7 .., 5 6 ..
    assert tokens[:2] == [8, 5] and parents[:2] == [-1, -1]      # a level at a time, the latest first
    paths = {}
    for node, (token, parent) in enumerate(zip(tokens, parents)):
        paths[node] = (*paths.get(parent, ()), token)
    assert (5, 7) in paths.values() and (5, 6) in paths.values()
    assert sum(parent == -1 for parent in parents) == 2          # 8 .. and 5 .. : the two 5s share a node
    assert len(tokens) == 8 and all(parent < node for node, parent in enumerate(parents))     # the budget, spent
    assert NgramDrafter().tree(history, 8, 1)[0] == NgramDrafter().draft(history, 8) == [8, 3, 1, 2]


def test_a_tree_verify_gives_each_node_the_logits_of_its_path(model):
    """Each node's row of forward_tree equals the logits after the prompt and its path alone."""
    tokens, parents = [7, 8, 9, 30, 31, 32], [-1, 0, 0, -1, 3, 1]
    with Runtime(model, ubatch=16) as runtime:
        prompt = prompt_of(runtime)
        cache = runtime.backend.new_cache(runtime.ctx)
        runtime.model.forward(np.asarray(prompt[:-1]), cache, all_logits=False)
        rows = runtime.model.forward_tree(np.asarray([prompt[-1], *tokens]), parents, cache)
        for node in range(-1, len(tokens)):
            path, at = [], node
            while at != -1:
                path.insert(0, tokens[at])
                at = parents[at]
            alone = runtime.logits([*prompt, *path])[-1]
            np.testing.assert_allclose(rows[node + 1], alone, rtol=0, atol=1e-4 * np.abs(alone).max())


class TreeDrafter(NgramDrafter):
    """Trees whose first branch is wrong and whose second is plain decoding's continuation."""

    def __init__(self, prompt, plain, vocab):
        super().__init__()
        self.sequence, self.vocab = prompt + plain, vocab

    def tree(self, history, most, branches):
        right = self.sequence[len(history):len(history) + max(1, most // 2)]
        if not right:
            return [], []
        wrong = [(right[0] + 1) % self.vocab, right[0]]          # a wrong first token, then a token of no path
        tokens = [*wrong, *right][:most]
        parents = [-1, 0, -1, *range(2, len(right) + 1)][:len(tokens)]
        return tokens, parents


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_tree_verifies_take_a_later_branch_and_keep_its_rows(model, monkeypatch, temperature):
    with Runtime(model, ubatch=16) as runtime:
        prompt = prompt_of(runtime)
        plain = list(runtime.generate(prompt, 48, GREEDY))
        drafter = TreeDrafter(prompt, plain, runtime.spec.vocab)
        monkeypatch.setattr(runtime, "_drafter", lambda params: drafter)
        stats = RunStats()
        sampling = SamplingParams(temperature=temperature, seed=2) if temperature else GREEDY
        tokens = list(runtime.generate(prompt, 48, sampling, stats=stats,
                                       speculation=SpecParams("ngram", draft_max=8, gated=False, branches=2)))
        after = list(runtime.generate(prompt, 6, GREEDY))
    assert len(tokens) == 48 and after == plain[:6]
    assert stats.speculation.verify_steps > 0
    if temperature == 0.0:
        assert tokens == plain
        assert stats.speculation.accepted_tokens > stats.speculation.verify_steps    # paths past the first node
