#!/usr/bin/env bash
# The ends of pyproject.toml's transformers range: run the tests that depend on transformers' Trainer internals
# against another transformers release, installed beside .venv's (nothing in .venv changes).
#
#   bash scripts/test_transformers_range.sh 5.20.2     # the lower end (the upper end, 5.25.0, is .venv's own)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-5.20.2}"
TARGET="${TMPDIR:-/tmp}/shardtrain-transformers-$VERSION"
[[ -d "$TARGET/transformers" ]] || .venv/bin/pip install -q --no-deps --target "$TARGET" "transformers==$VERSION"
export PYTHONPATH="$TARGET" OMP_NUM_THREADS=1 SHARDTRAIN_CPU=1
.venv/bin/python -c "import transformers; print('transformers', transformers.__version__)"
# the compatibility table (test_compat_table) lists the fields of the pinned dev version only
exec .venv/bin/python -m pytest -q tests/unit/test_arguments.py tests/unit/test_hf_argument_parser.py \
  tests/distributed/test_overrides.py tests/distributed/test_any_model.py tests/distributed/test_hf_fields.py "${@:2}"
