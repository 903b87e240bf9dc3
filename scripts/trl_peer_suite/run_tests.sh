#!/usr/bin/env bash
# Run from the project root after prepare.sh:
#   bash scripts/trl_peer_suite/run_tests.sh trl|st [pytest args...]
# TRL's six trainer test files on one tree: trl (TRL's trainers) or st (shardtrain.trl's, imports swapped).
# N=2 workers (pytest-xdist; N=1: one process), one thread each, Hub/datasets offline (stand-ins from prepare.sh).
# FILES="tests/test_sft_trainer.py ..." picks files. Results: /tmp/peer-trl/results/<side>.{xml,log,time}
set -uo pipefail
SIDE=${1:?trl or st}; shift
ROOT=${ROOT:-/tmp/peer-trl}
PY=${PY:-$PWD/.venv/bin/python}
N=${N:-2}
FILES=${FILES:-"tests/test_sft_trainer.py tests/test_dpo_trainer.py tests/test_grpo_trainer.py tests/test_rloo_trainer.py tests/test_kto_trainer.py tests/test_reward_trainer.py"}
mkdir -p "$ROOT/results"
cd "$ROOT/$SIDE"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONHASHSEED=0 CUDA_VISIBLE_DEVICES=""
export HF_HOME="$ROOT/standins/hf_home" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export WANDB_DISABLED=true WANDB_MODE=disabled DISABLE_MLFLOW_INTEGRATION=TRUE COMET_MODE=DISABLED TOKENIZERS_PARALLELISM=false
case "$SIDE" in st*) export SHARDTRAIN_CPU=1 ;; esac
TAG=${TAG:-$SIDE}
XDIST=(); [[ $N -gt 1 ]] && XDIST=(-n "$N")
TIMEOUT=(); "$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT=(--timeout 300)
# shellcheck disable=SC2086
/usr/bin/time -v "$PY" -m pytest $FILES "${XDIST[@]}" "${TIMEOUT[@]}" "$@" -p no:cacheprovider -q -rA \
    --junitxml="$ROOT/results/$TAG.xml" -o junit_family=xunit1 \
    > "$ROOT/results/$TAG.log" 2> "$ROOT/results/$TAG.time"
rc=$?
tail -3 "$ROOT/results/$TAG.log"; grep -E "Elapsed|Maximum resident" "$ROOT/results/$TAG.time"
exit $rc
