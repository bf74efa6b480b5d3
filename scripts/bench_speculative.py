"""Speculative decoding against plain decoding on one file: greedy tokens/s of plain, n-gram and
(with --draft) draft-model decoding after one prompt, the acceptance of each, and the cost of a
verify step of W tokens against W (one forward pass of W tokens at the prompt's end, as a verify
runs it, relative to a one-token step).

    python scripts/bench_speculative.py -m /tmp/moerun-bench-4-layers.gguf --threads 2
    python scripts/bench_speculative.py -m target.gguf --draft small.gguf --device cuda:0

The default prompt repeats a passage of text, the case n-gram drafting is for (quotes, edits of
code); --prompt-file gives another. Each figure is the best of --repetitions runs. Two more rows
bound the gate: a drafter whose every draft is wrong (`wrong`), gated and not, against plain.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from moerun.engine.runtime import RunStats, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.engine.speculative import SpecParams
from moerun.rig.settings import RigConfig

GREEDY = SamplingParams(temperature=0.0)
PASSAGE = ("def route(x, router, k):\n    logits = x @ router.T\n    ids = np.argsort(-logits, axis=-1)[:, :k]\n"
           "    weights = np.take_along_axis(logits, ids, axis=-1)\n    return ids, softmax(weights)\n\n")
WIDTHS = (1, 2, 4, 8, 16, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--draft", default=None, help="a draft model of the same vocabulary")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompt-file", default=None)
    parser.add_argument("-n", "--tokens", type=int, default=128)
    parser.add_argument("--draft-max", type=int, default=16)
    parser.add_argument("--branches", type=int, default=1, help="also n-gram trees of this many branches")
    parser.add_argument("-r", "--repetitions", type=int, default=2)
    args = parser.parse_args()
    text = open(args.prompt_file, encoding="utf-8").read() if args.prompt_file else PASSAGE * 4
    rig = RigConfig(device=args.device, threads=args.threads)
    with Runtime(args.model, ubatch=512, rig=rig, draft_model=args.draft) as runtime:
        prompt = runtime.tokenizer.encode(text)
        modes = {"plain": SpecParams(), "ngram": SpecParams("ngram", draft_max=args.draft_max),
                 **({f"ngram tree ({args.branches})": SpecParams("ngram", draft_max=args.draft_max,
                                                                 branches=args.branches)} if args.branches > 1 else {}),
                 "wrong, gated": SpecParams("ngram", draft_max=args.draft_max),
                 "wrong, --no-spec-gate": SpecParams("ngram", draft_max=args.draft_max, gated=False)}
        if args.draft:
            modes["draft"] = SpecParams("draft", draft_max=args.draft_max, draft_model=args.draft)
        drafter = runtime._drafter
        print(f"{args.model}, {len(prompt)}-token prompt, {args.tokens} greedy tokens, {args.device}\n")
        print("| decoding | t/s | x plain | verifies | accepted / drafted | tokens equal plain |")
        print("|---|---:|---:|---:|---:|---|")
        plain_rate, plain_tokens = 0.0, None
        for name, params in modes.items():
            best, tokens, stats = 0.0, None, None
            runtime._drafter = WrongDrafter if name.startswith("wrong") else drafter
            for _ in range(args.repetitions):
                run = RunStats()
                tokens = list(runtime.generate(prompt, args.tokens, GREEDY, stats=run, speculation=params))
                if run.decode_tokens_per_second > best:
                    best, stats = run.decode_tokens_per_second, run
            plain_rate, plain_tokens = (best, tokens) if name == "plain" else (plain_rate, plain_tokens)
            spec = stats.speculation
            counts = (f"{spec.verify_steps} | {spec.accepted_tokens} / {spec.drafted_tokens}" if spec is not None
                      else "— | —")
            print(f"| {name} | {best:.1f} | {best / plain_rate:.2f} | {counts} | {tokens == plain_tokens} |")
        print("\n| W | ms per pass | x one token |\n|---:|---:|---:|")
        one = None
        for width in WIDTHS:
            ms = verify_ms(runtime, prompt, width, args.repetitions)
            one = one or ms
            print(f"| {width} | {ms:.2f} | {ms / one:.2f} |")


class WrongDrafter:
    """Drafts that are never right: the token after the one the sequence ends with, repeated."""

    def __init__(self, params: SpecParams):
        self.vocab = None

    def draft(self, history, most):
        return [history[-1] + 1] * most


def verify_ms(runtime: Runtime, prompt: list[int], width: int, repetitions: int) -> float:
    """Milliseconds of one forward pass of `width` tokens after the prompt (all logits, as a
    verify asks), the best of `repetitions` passes on a prefilled cache."""
    context = runtime.context(prompt)
    cache = runtime.backend.restore_cache(context.state, runtime.ctx)
    ids = np.asarray(prompt[:width] if len(prompt) >= width else prompt * width)[:width]
    best = float("inf")
    for _ in range(repetitions + 1):                 # the first pass warms up
        started = time.perf_counter()
        runtime.model.forward(ids, cache, all_logits=True)
        best = min(best, time.perf_counter() - started)
        cache.truncate(len(prompt))
    return best * 1e3


if __name__ == "__main__":
    main()
