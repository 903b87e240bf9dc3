#!/usr/bin/env bash
# Run from the project root: bash scripts/trl_peer_suite/prepare.sh
# Builds, under /tmp/peer-trl (upstream code is never put in the project):
#   orig/      TRL's files at the mirror's HEAD (tests/ + the dataset scripts + pyproject.toml), verbatim; SOURCE = commit
#   standins/  tiny local models + data sets for "trl-internal-testing/..." (make_standins.py)
#   trl/       orig's tests, imports adapted to the installed trl (swap_imports.py); standins linked in
#   st/        the same, with the 12 trainer/config names taken from shardtrain.trl
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT=${ROOT:-/tmp/peer-trl}
PY=${PY:-$PWD/.venv/bin/python}
MIRROR=${MIRROR:?set MIRROR to a git clone (or bare git dir) of TRL, e.g. MIRROR=~/src/trl/.git}
REV=${REV:-HEAD}
FILES="tests/__init__.py tests/conftest.py tests/testing_utils.py tests/testing_constants.py
  tests/test_sft_trainer.py tests/test_dpo_trainer.py tests/test_grpo_trainer.py tests/test_rloo_trainer.py
  tests/test_kto_trainer.py tests/test_reward_trainer.py tests/data/template.jinja pyproject.toml
  scripts/generate_zen_dataset.py scripts/generate_toolcall_dataset.py scripts/generate_harmony_dataset.py"
rm -rf "$ROOT/orig" && mkdir -p "$ROOT/orig/tests/data" "$ROOT/orig/scripts/remote_code"
for f in $FILES; do git -C "$MIRROR" show "$REV:$f" > "$ROOT/orig/$f"; done
for f in configuration_remote.py modeling_remote.py; do  # the code of tiny-RemoteForCausalLM (trust_remote_code)
  git -C "$MIRROR" show "$REV:scripts/generate_tiny_models/for_causal_lm/_remote_code/$f" > "$ROOT/orig/scripts/remote_code/$f"
done
touch "$ROOT/orig/scripts/remote_code/__init__.py"
git -C "$MIRROR" rev-parse "$REV" > "$ROOT/orig/SOURCE"
echo "TRL tests from $(cat "$ROOT/orig/SOURCE"); installed trl $("$PY" -c 'import trl; print(trl.__version__)')"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$ROOT/standins/hf_home"
export HF_DATASETS_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
rm -rf "$ROOT/standins"
"$PY" "$HERE/make_standins.py" "$ROOT/standins" "$ROOT/orig" 2>&1 | grep -E "^(datasets|models|skip)"

for side in trl st; do
  rm -rf "$ROOT/$side" && mkdir -p "$ROOT/$side"
  "$PY" "$HERE/swap_imports.py" "$ROOT/orig/tests" "$ROOT/$side/tests" $([[ $side == st ]] && echo --shardtrain) \
    | sed "s|^|$side/tests/|"
  cp "$ROOT/orig/pyproject.toml" "$ROOT/$side/"  # TRL's [tool.pytest.ini_options] (markers, filterwarnings)
  for org in "$ROOT"/standins/*/; do  # repo ids ("trl-internal-testing/zen") resolve relative to the cwd
    [[ $(basename "$org") == hf_home ]] || ln -s "${org%/}" "$ROOT/$side/$(basename "$org")"
  done
done
# the two trees differ only by the swap lines
extra=$(diff -r "$ROOT/trl/tests" "$ROOT/st/tests" | grep '^[<>]' | grep -v '^> .*# peer_trl swap$' || true)
[[ -z $extra ]] || { echo "unexpected difference between trl/ and st/: $extra"; exit 1; }
echo "swap lines: $(grep -rc 'peer_trl swap' "$ROOT/st/tests" | awk -F: '{s+=$2} END {print s}')"
