#!/usr/bin/env bash
# Runs the tests marked gpu on a machine with a CUDA or ROCm GPU, against the
# installed moerun (pip install '.[cuda13]' or '.[rocm]' first). Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
run_dir="$(mktemp -d)"
trap 'rm -rf "$run_dir"' EXIT
cp -r "$repo/tests" "$repo/pyproject.toml" "$run_dir/"
cd "$run_dir"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu "$@"
