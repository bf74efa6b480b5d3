#!/usr/bin/env bash
# Installs what the test suite needs and runs it (extra arguments go to pytest):
# Debian's hipcc, to compile the GPU kernels for AMD targets, and systemd, for
# systemd-analyze, when they are missing and apt-get can run; then moerun (editable) and
# the Python test dependencies in .venv-test, an environment of the tests' own, so that a
# moerun installed in .venv keeps running meanwhile. Installing again is quick: pip keeps
# what is there. pytest's status 5 (no test collected, as for a -k that matches nothing)
# is not a failure.
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
[ -x .venv-test/bin/python ] || python3 -m venv .venv-test
.venv-test/bin/pip install -q -e ".[test]"
status=0
.venv-test/bin/python -m pytest -q "$@" || status=$?
if [ "$status" = 5 ]; then
    exit 0
fi
exit "$status"
