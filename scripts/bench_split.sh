#!/usr/bin/env bash
# The cost of layer shards on GPUs: `moerun bench` all-local on cuda:0, then with the layers from
# SPLIT_AT on a shard on the same GPU (the hop alone), and on cuda:1 when there are two GPUs;
# ROUNDS rounds alternated, one markdown table.
#
#   scripts/bench_split.sh [MODEL]        # knobs: SPLIT_AT (default: half the layers), ROUNDS,
#                                         # PAYLOAD (the shards' payload dtype), BENCH (extra flags)
set -uo pipefail
MODEL="${1:-${MODEL:-/tmp/b48.gguf}}"
ROUNDS="${ROUNDS:-2}"
PAYLOAD="${PAYLOAD:-bf16}"
BENCH="${BENCH:--p 512 -n 128 -r 3}"
PYTHON="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

[[ -f "$MODEL" ]] || "$PYTHON" "$REPO/scripts/make_bench_model.py" -o "$MODEL" >&2 || exit 2
LAYERS=$("$PYTHON" -c "import sys; from moerun.gguf.reader import GGUFFile; from moerun.models import load_spec
with GGUFFile(sys.argv[1]) as g: print(load_spec(g).n_layers)" "$MODEL") || exit 2
SPLIT_AT="${SPLIT_AT:-$((LAYERS / 2))}"
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)

setups=("all local|--device cuda:0" "shard on cuda:0 @$SPLIT_AT|--device cuda:0 --split cuda:0@$SPLIT_AT --payload-dtype $PAYLOAD")
((GPUS >= 2)) && setups+=("shard on cuda:1 @$SPLIT_AT|--device cuda:0 --split cuda:1@$SPLIT_AT --payload-dtype $PAYLOAD")

echo "| round | setup | test | t/s |"
echo "|---|---|---|---:|"
for round in $(seq "$ROUNDS"); do
    for setup in "${setups[@]}"; do
        name="${setup%%|*}"
        # shellcheck disable=SC2086 # the flags split at spaces on purpose
        "$PYTHON" -m moerun bench -m "$MODEL" $BENCH ${setup#*|} 2>/dev/null |
            sed -nE 's/.*\| *(pp[0-9]+|tg[0-9]+) *\| *([0-9.]+ ± [0-9.]+).*/\1 \2/p' |
            while read -r test value pm spread; do echo "| $round | $name | $test | $value ± $spread |"; done
    done
done
