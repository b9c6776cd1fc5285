#!/usr/bin/env bash
# Create .venv (if missing) and install miles-disagg into it. Idempotent: a second run
# with an unchanged pyproject.toml does nothing but check. Works with plain pip.
#   MILES_DISAGG_PYTHON   interpreter to build the venv with (default: python3)
#   MILES_DISAGG_EXTRAS   extras to install (default: test)
#   MILES_DISAGG_SGLANG_TIER=0  skip the SGLang conformance tier's packages (default: installed;
#                               CI needs them: tests/sglang fails there without them)
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${MILES_DISAGG_PYTHON:-python3}"
extras="${MILES_DISAGG_EXTRAS:-test}"
venv=".venv"
stamp="$venv/.miles-disagg-installed"
tier_dir="$venv/sglang-tier"
tier_req="scripts/sglang-tier.txt"
with_tier="${MILES_DISAGG_SGLANG_TIER:-1}"

log() { echo "[setup] $*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
  log "creating virtualenv $venv with $($python_bin --version 2>&1)"
  "$python_bin" -m venv "$venv"
fi
py="$venv/bin/python"

want="$(cat pyproject.toml "$tier_req" | sha256sum | cut -d' ' -f1) extras=$extras tier=$with_tier"
tier_present() { [ "$with_tier" != "1" ] || [ -d "$tier_dir/sglang" ]; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && tier_present && "$py" -c "import miles_disagg, torch" 2>/dev/null; then
  log "environment up to date ($venv)"
  exit 0
fi

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# Every module must end up byte-compiled: where PYTHONDONTWRITEBYTECODE is set (this project's machines
# set it), Python never writes a .pyc itself, and every process would compile every module it imports
# (torch, transformers, ray) from source, every time. pip compiles one file after another as it installs;
# instead the installs run with --no-compile (the SGLang tier beside the project's own), and compileall
# then compiles the whole environment on every core.
pip_install() { "$py" -m pip install --disable-pip-version-check -q --no-compile "$@"; }

if ! "$py" -c "import torch" 2>/dev/null; then
  if has_gpu; then
    log "GPU found: installing torch (CUDA build) with the project"
  else
    # A plain 'torch' requirement would pull a multi-GB CUDA build; take the CPU build first.
    log "no GPU: installing the CPU build of torch first"
    pip_install "torch==2.13.0"
  fi
fi

# The SGLang conformance tier: the real SGLang package judges our argv and request bodies.
# --no-deps everywhere (SGLang's own requirements pull a CUDA torch and GPU kernels), into a
# directory of its own: the tests/sglang conftest puts it on sys.path, nothing else sees it
# (a torchvision that cannot load its C++ ops must not reach transformers' import checks).
install_sglang_tier() {
  local torch_minor torchvision
  torch_minor="$("$py" -c "from importlib.metadata import version; print(version('torch').split('.')[1])")"
  torchvision="torchvision==0.$((torch_minor + 15)).*"  # torch 2.N pairs with torchvision 0.(N+15)
  log "installing the SGLang conformance tier into $tier_dir ($(grep -m1 '^sglang==' "$tier_req"), $torchvision)"
  rm -rf "$tier_dir.partial"
  pip_install --no-deps --target "$tier_dir.partial" -r "$tier_req" "$torchvision"
  rm -rf "$tier_dir"
  mv "$tier_dir.partial" "$tier_dir"
}
tier_pid=""
if [ "$with_tier" = "1" ]; then
  install_sglang_tier &
  tier_pid=$!
fi

log "installing miles-disagg[$extras] (editable)"
pip_install -e ".[$extras]"
if [ -n "$tier_pid" ] && ! wait "$tier_pid"; then
  log "the SGLang conformance tier did not install (MILES_DISAGG_SGLANG_TIER=0 skips it)"
  exit 1
fi

# Compile the environment (the tier: the sglang package its tests import), the project's own modules
# (installed editable, so not in site-packages) included. -j 0: one worker per core.
site="$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
log "byte-compiling the environment"
compile_dirs=("$site" miles_disagg)
[ -d "$tier_dir/sglang" ] && compile_dirs+=("$tier_dir/sglang")
"$py" -m compileall -q -j 0 "${compile_dirs[@]}" >/dev/null || true  # a file that does not compile is its package's
"$py" -c "import miles_disagg, torch; print(f'[setup] ready: torch {torch.__version__}')" >&2
echo "$want" > "$stamp"
