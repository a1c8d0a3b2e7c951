#!/usr/bin/env bash
# The stock Python Triton client against `epserve launch` (called from .ci/run): installs the
# pinned client into .venv-tritonclient, builds the release binary, runs check.py, then Triton's
# perf_analyzer.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=.venv-tritonclient
req=tests/tritonclient/requirements.txt
if ! cmp -s "$req" "$venv/requirements.txt" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q -r "$req"
  cp "$req" "$venv/requirements.txt"
fi
cargo build --locked --release --bin epserve
"$venv/bin/python" tests/tritonclient/check.py target/release/epserve
# Triton's perf_analyzer (its own pinned wheel, fetched once into the venv's folder).
"$venv/bin/python" tests/tritonclient/perf_analyzer.py target/release/epserve "$venv/perf_analyzer"
