#!/usr/bin/env bash
# Run from the project root: bash scripts/st_peer_suite/prepare.sh
# Builds, under /tmp/peer-st (upstream code is never put in the project):
#   orig/        sentence-transformers' test files at the mirror's HEAD (+ pyproject.toml), verbatim;
#                SOURCE = commit, TEST_FILES = the test files run (those of the list that exist at REV)
#   standins/    tiny local models (a Hub cache, hf_home/) + data sets (datasets/<org>/<name>) (make_standins.py)
#   sbert/       orig's tests, imports adapted to the installed sentence-transformers (swap_imports.py);
#                the data sets' org dirs linked in
#   shardtrain/  the same, with the trainer/arguments names taken from shardtrain.sentence_transformers
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT=${ROOT:-/tmp/peer-st}
PY=${PY:-$PWD/.venv/bin/python}
MIRROR=${MIRROR:-/work/.mirror/huggingface+sentence-transformers/repo}  # a clone or bare git dir of sentence-transformers
REV=${REV:-HEAD}
SUPPORT="tests/__init__.py tests/conftest.py tests/utils.py tests/base/__init__.py tests/base/modules/__init__.py
  tests/sentence_transformer/__init__.py tests/cross_encoder/__init__.py tests/cross_encoder/conftest.py
  tests/sparse_encoder/__init__.py tests/sparse_encoder/utils.py tests/multi_vector_encoder/__init__.py pyproject.toml"
TESTS="tests/sentence_transformer/test_trainer.py tests/sentence_transformer/test_training_args.py
  tests/base/test_trainer.py tests/sentence_transformer/test_train_stsb.py
  tests/sentence_transformer/test_model_card.py tests/base/test_model_card.py tests/cross_encoder/test_model_card.py
  tests/sparse_encoder/test_model_card.py tests/base/modules/test_router.py
  tests/cross_encoder/test_trainer.py tests/cross_encoder/test_train_stsb.py
  tests/sparse_encoder/test_trainer.py tests/sparse_encoder/test_train_stsb.py"
# the multi-vector encoder's trainer tests only where the installed package has that trainer
if "$PY" -c 'import sentence_transformers as s; s.MultiVectorEncoderTrainer' 2>/dev/null; then
  TESTS="$TESTS tests/multi_vector_encoder/test_trainer.py tests/multi_vector_encoder/test_model_card.py"
else
  echo "skip tests/multi_vector_encoder: the installed sentence-transformers has no MultiVectorEncoderTrainer"
fi

rm -rf "$ROOT/orig" && mkdir -p "$ROOT/orig"
: > "$ROOT/orig/TEST_FILES"
for f in $SUPPORT $TESTS; do
  if ! git -C "$MIRROR" cat-file -e "$REV:$f" 2>/dev/null; then echo "skip $f: not at $REV"; continue; fi
  mkdir -p "$ROOT/orig/$(dirname "$f")"
  git -C "$MIRROR" show "$REV:$f" > "$ROOT/orig/$f"
  [[ " $(echo $TESTS) " == *" $f "* ]] && echo "$f" >> "$ROOT/orig/TEST_FILES"
done
git -C "$MIRROR" rev-parse "$REV" > "$ROOT/orig/SOURCE"
echo "sentence-transformers tests from $(cat "$ROOT/orig/SOURCE")" \
  "($(git -C "$MIRROR" show "$REV:pyproject.toml" | grep -m1 -E '^version' || echo 'version ?')," \
  "$(wc -l < "$ROOT/orig/TEST_FILES") test files);" \
  "installed sentence-transformers $("$PY" -c 'import sentence_transformers as s; print(s.__version__)')"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$ROOT/standins/hf_home"
export HF_DATASETS_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export HF_HUB_DISABLE_PROGRESS_BARS=1
rm -rf "$ROOT/standins"
"$PY" "$HERE/make_standins.py" "$ROOT/standins" 2>&1 | grep -E "^(datasets|models|skip)"

for side in sbert shardtrain; do
  rm -rf "$ROOT/$side" && mkdir -p "$ROOT/$side"
  "$PY" "$HERE/swap_imports.py" "$ROOT/orig/tests" "$ROOT/$side/tests" $([[ $side == shardtrain ]] && echo --shardtrain) \
    | sed "s|^|$side/tests/|"
  cp "$ROOT/orig/pyproject.toml" "$ROOT/orig/TEST_FILES" "$ROOT/$side/"  # [tool.pytest.ini_options]: markers, addopts
  for org in "$ROOT"/standins/datasets/*/; do  # data set ids ("sentence-transformers/stsb") resolve relative to the cwd
    ln -s "${org%/}" "$ROOT/$side/$(basename "$org")"
  done
done
# the two trees differ only by the swap lines
extra=$(diff -r "$ROOT/sbert/tests" "$ROOT/shardtrain/tests" | grep '^[<>]' | grep -v '^> .*# peer_st swap$' || true)
[[ -z $extra ]] || { echo "unexpected difference between sbert/ and shardtrain/: $extra"; exit 1; }
echo "swap lines: $(grep -rc 'peer_st swap' "$ROOT/shardtrain/tests" | awk -F: '{s+=$2} END {print s}')"
