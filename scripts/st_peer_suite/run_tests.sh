#!/usr/bin/env bash
# Run from the project root after prepare.sh:
#   bash scripts/st_peer_suite/run_tests.sh sbert|shardtrain [pytest args...]
# sentence-transformers' trainer test files on one tree: sbert (its own trainers) or shardtrain
# (shardtrain.sentence_transformers' trainers, imports swapped).
# SELECT=all (default: the default selection and the slow tests, i.e. -m "not custom"), default (the package's own
# addopts, -m "not slow and not custom") or slow (-m slow). N=2 workers (pytest-xdist; N=1: one process), one thread
# each, Hub/datasets offline (stand-ins from prepare.sh). FILES="tests/..." picks files (default: orig/TEST_FILES).
# Results: /tmp/peer-st/results/<TAG>.{xml,log,time,source} (source: the project's commit + uncommitted src/ diff),
# TAG defaults to the side.
set -uo pipefail
SIDE=${1:?sbert or shardtrain}; shift
ROOT=${ROOT:-/tmp/peer-st}
PY=${PY:-$PWD/.venv/bin/python}
N=${N:-2}
SELECT=${SELECT:-all}
FILES=${FILES:-$(cat "$ROOT/$SIDE/TEST_FILES")}
case "$SELECT" in
  all) MARK=(-m "not custom") ;;
  default) MARK=() ;;  # pyproject.toml's addopts: -m 'not slow and not custom'
  slow) MARK=(-m slow) ;;
  *) echo "SELECT=all|default|slow"; exit 2 ;;
esac
mkdir -p "$ROOT/results"
TAG=${TAG:-$SIDE}
{ date -u +"start %FT%TZ"; echo "SELECT=$SELECT N=$N"; git rev-parse HEAD 2>/dev/null  # the project state this run used
  echo "uncommitted src/: $(git diff --stat -- src 2>/dev/null | tail -1) (diff md5 $(git diff -- src 2>/dev/null | md5sum | cut -c1-12))"
} > "$ROOT/results/$TAG.source"
cd "$ROOT/$SIDE"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONHASHSEED=0 CUDA_VISIBLE_DEVICES=""
export HF_HOME="$ROOT/standins/hf_home" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export WANDB_DISABLED=true WANDB_MODE=disabled DISABLE_MLFLOW_INTEGRATION=TRUE COMET_MODE=DISABLED TOKENIZERS_PARALLELISM=false
export HF_HUB_DISABLE_PROGRESS_BARS=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1
unset CI GITHUB_ACTIONS  # the tests skip their longer trainings under CI
case "$SIDE" in shardtrain*) export SHARDTRAIN_CPU=1 ;; esac
XDIST=(); [[ $N -gt 1 ]] && XDIST=(-n "$N")
TIMEOUT=(); "$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT=(--timeout 300)
# shellcheck disable=SC2086
/usr/bin/time -v "$PY" -m pytest $FILES "${MARK[@]}" "${XDIST[@]}" "${TIMEOUT[@]}" "$@" -p no:cacheprovider -q -rA \
    --junitxml="$ROOT/results/$TAG.xml" -o junit_family=xunit1 \
    > "$ROOT/results/$TAG.log" 2> "$ROOT/results/$TAG.time"
rc=$?
tail -3 "$ROOT/results/$TAG.log"; grep -E "Elapsed|Maximum resident" "$ROOT/results/$TAG.time"
exit $rc
