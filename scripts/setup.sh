#!/usr/bin/env bash
# Create .venv (once) and install torch==2.13.0 first (the CPU build), then shardtrain:
#   bash scripts/setup.sh        # with the dev extra (everything the tests and docs use)
#   bash scripts/setup.sh demo   # with the report extra only (what the demo needs), unless already installed
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip "setuptools>=70.1"
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q torch==2.13.0
fi
if [[ "${1:-dev}" == "demo" ]]; then
  if ! .venv/bin/python -c "import shardtrain, matplotlib" 2>/dev/null; then
    .venv/bin/pip install -q --no-build-isolation -e ".[report]"
  fi
else
  .venv/bin/pip install -q --no-build-isolation -e ".[dev]"
fi
