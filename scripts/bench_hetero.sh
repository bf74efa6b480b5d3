#!/usr/bin/env bash
# Heterogeneous rig on one host with two NVIDIA GPUs: the parent on cuda:0, one expert daemon
# on cuda:1, on the 48-layer Qwen3-30B-A3B-shaped Q4_K_M-like file; all in one run.
#
#   scripts/bench_hetero.sh [MODEL [OUT]]      # or MODEL=... OUT=... scripts/bench_hetero.sh
#
# Writes one `moerun bench -o json` file per configuration to OUT (its stderr to a .log next
# to it), then prints scripts/hetero_table.py's tables:
#   local.json                       all experts on cuda:0
#   <transport>-batched-<share>.json pp512 and tg128, <share>% of each layer's experts on the daemon
#   <transport>-stream-<share>.json  pp512 only, stream-mode prefill (-n 0 skips tg)
# A configuration that fails is reported and the next one runs; the exit status is 1 if any failed.
# Needs moerun installed for $PYTHON (pip install -e '.[cuda13]'); NCCL is not used.
set -uo pipefail

# -- knobs ----------------------------------------------------------------------------------
MODEL="${1:-${MODEL:-/tmp/b48.gguf}}"
OUT="${2:-${OUT:-./hetero-results}}"
PYTHON="${PYTHON:-python3}"
PARENT_DEVICE="${PARENT_DEVICE:-cuda:0}"
DAEMON_DEVICE="${DAEMON_DEVICE:-cuda:1}"
TRANSPORTS="${TRANSPORTS:-device shared}"
SHARES="${SHARES:-25 50 75}"        # percent of each layer's experts on the daemon
N_EXPERTS="${N_EXPERTS:-128}"      # experts per layer in MODEL
REPETITIONS="${REPETITIONS:-3}"
export CUDA_DEVICE_ORDER="${CUDA_DEVICE_ORDER:-PCI_BUS_ID}"   # cuda:N numbered as nvidia-smi numbers them
# -------------------------------------------------------------------------------------------

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
failed=()

if ! "$PYTHON" -c "import moerun.bench" 2>/dev/null; then
    echo "bench_hetero: $PYTHON cannot import moerun; install it first (pip install -e \"$REPO[cuda13]\")" >&2
    exit 2
fi
if [[ ! -f "$MODEL" ]]; then
    echo "bench_hetero: $MODEL is missing; writing it" >&2
    "$PYTHON" "$REPO/scripts/make_bench_model.py" -o "$MODEL" || { echo "bench_hetero: could not write $MODEL" >&2; exit 2; }
fi
mkdir -p "$OUT" || exit 2
if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L >"$OUT/gpus.txt" 2>&1
fi

# run NAME BENCH-FLAGS...: OUT/NAME.json on success, OUT/NAME.log always
run() {
    local name="$1"
    shift
    local json="$OUT/$name.json" log="$OUT/$name.log"
    rm -f "$json"
    echo "bench_hetero: $name: moerun bench $*" >&2
    "$PYTHON" -m moerun bench -m "$MODEL" -r "$REPETITIONS" -o json "$@" >"$json.partial" 2>"$log"
    local status=$?
    if ((status == 0)); then
        mv "$json.partial" "$json"
    else
        rm -f "$json.partial"
        echo "bench_hetero: $name FAILED (exit $status); see $log" >&2
        failed+=("$name")
    fi
}

run local --device "$PARENT_DEVICE" -p 512 -n 128
for share in $SHARES; do
    hot=$((N_EXPERTS - N_EXPERTS * share / 100))
    for transport in $TRANSPORTS; do
        rig=(--device "$PARENT_DEVICE" --daemon "$DAEMON_DEVICE" --hot "$hot" --transport "$transport")
        run "$transport-batched-$share" "${rig[@]}" --mode batched -p 512 -n 128
        run "$transport-stream-$share" "${rig[@]}" --mode stream -p 512 -n 0
    done
done

"$PYTHON" "$REPO/scripts/hetero_table.py" "$OUT" || failed+=("hetero_table.py")
if ((${#failed[@]})); then
    echo "bench_hetero: failed: ${failed[*]}" >&2
    exit 1
fi
