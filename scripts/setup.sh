#!/usr/bin/env bash
# Create .venv (once) and install: torch==2.13.0 first (the CPU build), then shardtrain with its dev extra.
# Usage: bash scripts/setup.sh        (idempotent; re-installs the package, not torch)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip "setuptools>=68"
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q torch==2.13.0
fi
.venv/bin/pip install -q --no-build-isolation -e ".[dev]"
