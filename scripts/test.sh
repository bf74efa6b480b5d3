#!/usr/bin/env bash
# Installs what the test suite needs and runs it (extra arguments go to pytest):
# Debian's hipcc, to compile the GPU kernels for AMD targets, and systemd, for
# systemd-analyze, when they are missing and apt-get can run; then the Python test
# dependencies in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v hipcc >/dev/null || missing+=(hipcc)
command -v systemd-analyze >/dev/null || missing+=(systemd)
if ((${#missing[@]})); then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "note: ${missing[*]} not installed (installing needs root and apt-get); the tests that use them skip" >&2
    fi
fi
python3 -m venv .venv
.venv/bin/pip install -q -e ".[test]"
.venv/bin/python -m pytest -q "$@"
