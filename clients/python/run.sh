#!/usr/bin/env bash
# The Python client (clients/python) against `epserve launch` (called from .ci/run): installs the
# pinned test requirements into .venv-python, builds and installs the package from this checkout
# (its gRPC stubs compiled from proto/ at build time), builds the release binary, runs the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=.venv-python
req=clients/python/requirements-test.txt
# torch's wheels are 2.6 GB: not kept twice (pip's cache and the venv).
export PIP_NO_CACHE_DIR=1
if ! cmp -s "$req" "$venv/requirements.txt" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q -r "$req"
  cp "$req" "$venv/requirements.txt"
fi
"$venv/bin/pip" install -q --force-reinstall --no-deps ./clients/python
cargo build --locked --release --bin epserve
# From the repository root: the tests import the installed package, not clients/python/epserve.
"$venv/bin/python" -m pytest -q -p no:cacheprovider clients/python/tests
