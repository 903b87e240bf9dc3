#!/usr/bin/env bash
# The main job: set up .venv if needed (the package and its report extra), then train the demo on 2 CPU ranks with FSDP2.
# Usage: bash scripts/demo.sh [train_demo.py args, e.g. --max_steps 100 or --seed 3]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
export OMP_NUM_THREADS=1
exec .venv/bin/shardtrain launch --cpu --num_processes 2 examples/train_demo.py "$@"
