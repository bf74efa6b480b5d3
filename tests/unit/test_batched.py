"""Sequences decoded together (Runtime.generate_batch, MoEModel.forward_batch: one forward pass
for every running sequence's tokens, attention and DeltaNet states per sequence) give each
sequence what the same request gives alone, token for token on the CPU parent's float32 path:
prompts of different lengths, sequences leaving at different lengths, seeded sampling, every
architecture and the hybrid one; with a prefix cache, sequences that resume from its snapshots
(taken alone or batched, read back from disk or refused there) too."""
from __future__ import annotations

import numpy as np
import pytest

from moerun.engine.prefix_cache import PrefixCache
from moerun.engine.runtime import RequestError, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.engine.scheduler import BatchStats, Scheduler
from tests.support.hf_models import ARCHS, HYBRID_ARCHS, tiny_model
from tests.support.to_gguf import write_gguf

PROMPT_LENGTHS = (5, 17, 40, 1)
NEW_TOKENS = (12, 3, 20, 8)
GREEDY = SamplingParams(temperature=0.0)
MOST_STEPS = 300            # a scheduler's steps before a test gives up on it


@pytest.fixture(scope="module", params=[*ARCHS, *HYBRID_ARCHS])
def model(request, tmp_path_factory):
    return write_gguf(tiny_model(request.param), tmp_path_factory.mktemp("batched") / f"{request.param}.gguf", "Q8_0")


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENGTHS]


def alone(model, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """Each (prompt, max_new_tokens) request's greedy tokens, generated one at a time by a runtime
    without a prefix cache."""
    with Runtime(model, ubatch=8) as runtime:
        return [list(runtime.generate(prompt, n, GREEDY)) for prompt, n in requests]


def decode_joining(scheduler: Scheduler, requests: list[tuple[list[int], int]], joins) -> list[list[int]]:
    """Each (prompt, max_new_tokens) request's greedy tokens through the scheduler, the requests
    added in order, the next one before each step where joins(step, ended) holds (ended: the
    requests that left the batch)."""
    tokens: list[list[int]] = [[] for _ in requests]
    joined: dict[int, int] = {}
    ended: set[int] = set()
    for step in range(MOST_STEPS):
        if len(joined) < len(requests) and joins(step, ended):
            prompt, n = requests[len(joined)]
            joined[scheduler.add(prompt, n, GREEDY)] = len(joined)
        for event in scheduler.step() if scheduler.running else ():
            if event.token is not None:
                tokens[joined[event.sequence]].append(event.token)
            if event.finish is not None:
                ended.add(joined[event.sequence])
        if len(ended) == len(requests):
            return tokens
    raise AssertionError(f"the requests did not end within {MOST_STEPS} steps")


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_each_sequence_of_a_batch_decodes_as_it_does_alone(model, temperature):
    sampling = [SamplingParams(temperature=temperature, seed=11 + b) for b in range(len(PROMPT_LENGTHS))]
    with Runtime(model, ubatch=16) as runtime:
        batch_prompts = prompts(runtime.spec.vocab)
        alone = [list(runtime.generate(p, n, s)) for p, n, s in zip(batch_prompts, NEW_TOKENS, sampling)]
        stats = BatchStats()
        together = runtime.generate_batch(batch_prompts, NEW_TOKENS, sampling, stats=stats)
    assert together == alone
    assert [len(tokens) for tokens in together] == list(NEW_TOKENS)
    assert stats.prompt_tokens == sum(PROMPT_LENGTHS) and stats.decode_steps >= max(NEW_TOKENS) - 1
    assert stats.decoded_tokens == sum(NEW_TOKENS) - len(NEW_TOKENS)      # the first tokens come from prefill


def test_sequences_joining_a_running_batch_decode_as_they_do_alone(model):
    """Continuous batching: a sequence added while others decode is prefilled in the same steps
    as their decode tokens (within the step's budget of ubatch tokens) and decodes alongside."""
    with Runtime(model, ubatch=8) as runtime:
        requests = list(zip(prompts(runtime.spec.vocab), NEW_TOKENS))
        tokens = decode_joining(runtime.scheduler(), requests, lambda step, ended: step % 3 == 0)  # every third step
    assert tokens == alone(model, requests)


def test_a_stop_id_takes_a_sequence_out_of_the_batch(model):
    greedy = [SamplingParams(temperature=0.0)] * 2
    with Runtime(model) as runtime:
        batch_prompts = prompts(runtime.spec.vocab)[:2]
        first = list(runtime.generate(batch_prompts[0], 6, greedy[0]))
        stop = frozenset({first[3]})
        alone = [list(runtime.generate(p, 6, s, stop_ids=stop)) for p, s in zip(batch_prompts, greedy)]
        assert runtime.generate_batch(batch_prompts, [6, 6], greedy, stop_ids=stop) == alone
    assert len(alone[0]) == first.index(first[3])


def test_a_batch_takes_one_length_and_one_sampling_per_prompt(model):
    with Runtime(model) as runtime:
        with pytest.raises(RequestError, match="one max_new_tokens and one sampling per prompt"):
            runtime.generate_batch([[1, 2]], [3, 4], [SamplingParams()])
        tokens = runtime.generate_batch([[1, 2], [3]], [0, 2], [SamplingParams(temperature=0.0)] * 2)
    assert tokens[0] == [] and len(tokens[1]) == 2


def test_batched_bench_prints_llama_batched_benchs_table(moerun):
    result = moerun("batched-bench", "-npp", "16,8", "-ntg", "4", "-npl", "1,3", "-c", "59")
    assert result.exit_code == 0, result.output
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()
            if line.startswith("|") and line[2:7].strip().isdigit()]
    # 3·(16 + 4) = 60 positions > 59: left out
    assert [row[:4] for row in rows] == [["16", "4", "1", "20"], ["8", "4", "1", "12"], ["8", "4", "3", "36"]]
    for pp, tg, b, n_kv, t_pp, s_pp, t_tg, s_tg, t, s in (map(float, row) for row in rows):
        for rate, tokens, seconds in ((s_pp, b * pp, t_pp), (s_tg, b * tg, t_tg), (s, n_kv, t)):
            assert rate == pytest.approx(tokens / seconds, rel=0.01 + 0.0006 / seconds)   # seconds printed to 1 ms
        assert t == pytest.approx(t_pp + t_tg, abs=2e-3)
    refused = moerun("batched-bench", "-npp", "16", "-ntg", "4", "-npl", "2", "-c", "10")
    assert refused.exit_code == 2 and "hold none of the cases" in refused.stderr


def test_forked_sequences_go_on_as_the_shared_prompt_does_alone(model):
    """A sequence's cache copied into two more (llama-batched-bench's shared prompt): each of the
    three decodes the lone run's tokens, seeded sampling included."""
    sampling = SamplingParams(temperature=0.8, seed=5)
    with Runtime(model) as runtime:
        prompt = prompts(runtime.spec.vocab)[2]
        alone = list(runtime.generate(prompt, 8, sampling))
        scheduler = runtime.scheduler()
        first = scheduler.add(prompt, 8, sampling)
        tokens = {first: []}
        while not tokens[first]:
            tokens[first] += [e.token for e in scheduler.step() if e.token is not None]
        tokens.update({fork: list(tokens[first]) for fork in scheduler.fork(first, 2)})
        while scheduler.running:
            for event in scheduler.step():
                if event.token is not None:
                    tokens[event.sequence].append(event.token)
    assert list(tokens.values()) == [alone] * 3


def test_batched_bench_with_a_shared_prompt_counts_it_once(moerun):
    result = moerun("batched-bench", "-npp", "16", "-ntg", "4", "-npl", "3", "-pps")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if line.startswith("|") and line[2:7].strip().isdigit())
    assert [cell.strip() for cell in row.split("|")[1:5]] == ["16", "4", "3", str(16 + 3 * 4)]


def test_a_sequence_outgrowing_the_kv_pool_is_the_same_error_as_alone(model):
    greedy = SamplingParams(temperature=0.0)
    with Runtime(model, ctx=64, kv_pool=10) as runtime:
        prompt = prompts(runtime.spec.vocab)[0]                  # 5 tokens: room for 5 more
        with pytest.raises(RequestError, match="the KV pool holds 10") as alone:
            list(runtime.generate(prompt, 20, greedy))
        with pytest.raises(RequestError) as together:
            runtime.generate_batch([prompt, prompt[:2]], [20, 3], [greedy] * 2)
    assert str(together.value) == str(alone.value)


def test_the_next_turn_of_a_finished_request_resumes_from_its_answers_snapshot(model):
    """A batch where one request ends, then its conversation's next turn (its prompt and answer,
    then more) joins while another request still decodes: that turn resumes from the snapshot
    taken at the end of the first answer and gives the tokens it gives alone without a prefix
    cache, as do the others."""
    with Runtime(model) as runtime:
        first, follow_up, other = prompts(runtime.spec.vocab)[1], prompts(runtime.spec.vocab)[0], [3] * 30
    answer, = alone(model, [(first, 5)])
    requests = [(first, 5), (other, 20), (first + answer + follow_up, 8)]
    prefix_cache, stats = PrefixCache(slots=8, interval=0), BatchStats()
    with Runtime(model, ubatch=8, prefix_cache=prefix_cache) as runtime:
        tokens = decode_joining(runtime.scheduler(stats), requests, lambda step, ended: step < 2 or 0 in ended)
    assert tokens == alone(model, requests)
    assert stats.restored_tokens == len(first + answer) - 1          # the answer's last token was never run
    assert prefix_cache.stats.lookups == 3 and prefix_cache.stats.hits == 1
    assert first in prefix_cache and (first + answer)[:-1] in prefix_cache      # the prompt's end, the answer's


def test_sequences_joining_mid_prefill_resume_from_the_snapshots_at_the_interval(model):
    """Requests sharing a 40-token prefix join every other step of a batch whose first request
    is still prefilling it: its chunks end at every 8th position, where it leaves a snapshot,
    and each later request resumes from the longest there is; every request gives the tokens
    it gives alone without a prefix cache."""
    with Runtime(model) as runtime:
        shared, *questions = (prompts(runtime.spec.vocab)[i] for i in (2, 0, 1, 3))
    requests = [(shared + question, n) for question, n in zip(questions, (6, 4, 9))]
    prefix_cache, stats = PrefixCache(slots=16, interval=8), BatchStats()
    with Runtime(model, ubatch=8, prefix_cache=prefix_cache) as runtime:
        tokens = decode_joining(runtime.scheduler(stats), requests, lambda step, ended: step % 2 == 0)
    assert tokens == alone(model, requests)
    assert all(shared[:position] in prefix_cache for position in range(8, len(shared) + 1, 8))
    assert prefix_cache.stats.hits == 2 and stats.restored_tokens == prefix_cache.stats.restored_tokens > 0


def test_a_snapshot_whose_file_fails_its_digest_is_refused_and_the_batch_answers_right(model, tmp_path, caplog):
    """Every snapshot file of a prefix damaged past its header: a batched request restores each
    in turn while its check runs, drops it when the check fails (before a snapshot is taken
    from it or its first token goes out) and ends up prefilling its whole prompt."""
    with Runtime(model) as runtime:
        shared, question, other = (prompts(runtime.spec.vocab)[i] for i in (2, 0, 1))
    with Runtime(model, prefix_cache=PrefixCache(slots=8, interval=8, folder=tmp_path, disk_budget=1 << 30)) as first:
        list(first.generate(shared, 0, GREEDY))                        # files at 8, 16, 24, 32 and 40 tokens
    files = sorted(tmp_path.glob("*/*.snap"))
    for path in files:
        data = bytearray(path.read_bytes())
        data[-33] ^= 0xFF                                              # the body's last byte: the header still reads
        path.write_bytes(bytes(data))
    prefix_cache, stats = PrefixCache(slots=8, interval=8, folder=tmp_path, disk_budget=1 << 30), BatchStats()
    requests = [(shared + question, 7), (other, 5)]
    with Runtime(model, ubatch=8, prefix_cache=prefix_cache) as runtime:
        tokens = runtime.generate_batch(*zip(*requests), [GREEDY] * 2, stats=stats)
    assert tokens == alone(model, requests)
    assert len(files) == 5 and caplog.text.count("digest does not match") == 5
    assert stats.restored_tokens == 0 and prefix_cache.stats.hits == prefix_cache.stats.disk_hits == 0
