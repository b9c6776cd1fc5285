#!/usr/bin/env bash
# Create .venv (if missing) and install miles-disagg into it. Idempotent: a second run
# with an unchanged pyproject.toml does nothing but check. Works with plain pip.
#   MILES_DISAGG_PYTHON   interpreter to build the venv with (default: python3)
#   MILES_DISAGG_EXTRAS   extras to install (default: test)
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${MILES_DISAGG_PYTHON:-python3}"
extras="${MILES_DISAGG_EXTRAS:-test}"
venv=".venv"
stamp="$venv/.miles-disagg-installed"

log() { echo "[setup] $*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
  log "creating virtualenv $venv with $($python_bin --version 2>&1)"
  "$python_bin" -m venv "$venv"
fi
py="$venv/bin/python"

want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1) extras=$extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$py" -c "import miles_disagg, torch" 2>/dev/null; then
  log "environment up to date ($venv)"
  exit 0
fi

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

pip_install() { "$py" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$py" -c "import torch" 2>/dev/null; then
  if has_gpu; then
    log "GPU found: installing torch (CUDA build) with the project"
  else
    # A plain 'torch' requirement would pull a multi-GB CUDA build; take the CPU build first.
    log "no GPU: installing the CPU build of torch first"
    pip_install "torch==2.13.0"
  fi
fi

log "installing miles-disagg[$extras] (editable)"
pip_install -e ".[$extras]"
"$py" -c "import miles_disagg, torch; print(f'[setup] ready: torch {torch.__version__}')" >&2
echo "$want" > "$stamp"
