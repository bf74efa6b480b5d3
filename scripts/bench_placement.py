"""Profiled placement against --hot N with the same number of experts on the parent.

    python scripts/make_synthetic_model.py -o /tmp/skewed.gguf --preset skewed
    python scripts/bench_placement.py -m /tmp/skewed.gguf --hot 8 --profile-prompts P.txt --prompts Q.txt

Profiles the routing on one set of prompts, plans a placement with exactly the parent memory
that --hot N needs, then generates from another set of prompts both ways (one CPU daemon)
and prints the share of routed pairs that stayed on the parent and the IPC traffic.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from moerun.backends.kv_types import KVTypes
from moerun.engine.report import stats_document
from moerun.engine.runtime import RunStats, Runtime
from moerun.engine.sampler import SamplingParams
from moerun.moe.planner import DeviceBudget, PlanRequest, explain, model_sizes, plan
from moerun.rig.settings import RigConfig

N_PREDICT = 24


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--hot", type=int, default=8, help="experts per layer on the parent")
    parser.add_argument("--profile-prompts", required=True, help="prompts to profile, one per line")
    parser.add_argument("--prompts", required=True, help="prompts to measure with, one per line")
    args = parser.parse_args()
    profile_prompts = [line for line in Path(args.profile_prompts).read_text().splitlines() if line.strip()]
    prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]

    with Runtime(args.model, count_routing=True) as runtime:
        for prompt in profile_prompts:
            list(runtime.generate(runtime.tokenizer.encode(prompt), N_PREDICT, SamplingParams(temperature=0.0)))
        sizes = model_sizes(runtime.gguf, runtime.spec)
        n_moe = sum(sizes.moe_layers)
        parent_bytes = (sizes.non_expert_bytes + sizes.kv_token_bytes(KVTypes("f16", "f16")) * runtime.ctx
                        + args.hot * max(sizes.expert_bytes) * n_moe)
        request = PlanRequest(sizes=sizes, parent=DeviceBudget("parent", parent_bytes, is_parent=True),
                              daemons=(DeviceBudget("cpu", 64 << 30),), context=runtime.ctx,
                              routing_counts=runtime.routing_counts(), safety_bytes=0, workspace_bytes=0)
        result = plan(request)
        placement_file = Path(tempfile.mkdtemp()) / "placement.json"
        placement_file.write_text(result.placement.to_json(runtime.gguf.fingerprint()))
    print(explain(result), "\n")

    print("| placement | experts on parent | routed pairs on parent | IPC calls | MiB sent | decode t/s |")
    print("|---|---|---|---|---|---|")
    for name, rig in ((f"--hot {args.hot}", RigConfig(daemons=("cpu",), hot=args.hot)),
                      ("profiled plan", RigConfig(daemons=("cpu",), placement=str(placement_file)))):
        with Runtime(args.model, rig=rig) as runtime:
            on_parent = sum(int((homes == -1).sum()) for homes in runtime.rig.placement.homes.values())
            steps, seconds = 0, 0.0
            for prompt in prompts:
                stats = RunStats()
                list(runtime.generate(runtime.tokenizer.encode(prompt), N_PREDICT, SamplingParams(temperature=0.0),
                                      stats=stats))
                steps, seconds = steps + stats.decode_steps, seconds + stats.decode_seconds
            document = stats_document(runtime, RunStats())
        daemon = document["daemons"][0]
        print(f"| {name} | {on_parent} | {1 - document['remote_pair_share']:.1%} | {daemon['calls']} "
              f"| {daemon['mib_sent']:.2f} | {steps / seconds:.1f} |")


if __name__ == "__main__":
    main()
