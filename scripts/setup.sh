#!/usr/bin/env bash
# Create .venv (if missing) and install miles-disagg into it. Idempotent: a second run
# with an unchanged pyproject.toml does nothing but check. Works with plain pip.
#   MILES_DISAGG_PYTHON   interpreter to build the venv with (default: python3)
#   MILES_DISAGG_EXTRAS   extras to install (default: test,tracking: tensorboard and wandb)
#   MILES_DISAGG_SGLANG_TIER=0  skip the SGLang conformance tier's packages (default: installed;
#                               CI needs them: tests/sglang fails there without them)
#   MILES_DISAGG_INSTALLER=pip  install with pip only (default: uv, installed into the venv with pip,
#                               with pip's own indexes, links and constraints; pip whenever uv fails)
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${MILES_DISAGG_PYTHON:-python3}"
extras="${MILES_DISAGG_EXTRAS:-test,tracking}"
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

# Nothing is byte-compiled here (--no-compile; uv does not compile): a run of this project imports less
# than half of the environment's modules (7,700 of 17,000 in the whole test suite), and Python writes
# each one's byte code the first time a process imports it -- unless PYTHONDONTWRITEBYTECODE is set,
# as on this project's machines, where every process would compile every module it imports, every
# time. demo.sh and test.sh unset it for their runs; unset it for runs of your own too.
pip_install() { "$py" -m pip install --disable-pip-version-check -q --no-compile "$@"; }

# uv resolves and unpacks in parallel (the project's dependencies: about 10 s against pip's 80 s). It
# does not read pip's configuration, so it gets pip's indexes, find-links and constraint files (as
# `pip config list` reports them) and pip's choice among indexes: the best version on any of them.
uv_args=()
use_uv() {
  [ "${MILES_DISAGG_INSTALLER:-uv}" = "uv" ] || return 1
  [ -x "$venv/bin/uv" ] || pip_install uv >/dev/null 2>&1 || return 1
  [ "${#uv_args[@]}" -gt 0 ] && return 0
  uv_args=(--python "$py" --index-strategy unsafe-best-match -q)
  local key value item
  while IFS='=' read -r key value; do
    value="${value#\'}"; value="${value%\'}"
    for item in $value; do
      case "${key##*.}" in
        index-url) uv_args+=(--index-url "$item") ;;
        extra-index-url) uv_args+=(--extra-index-url "$item") ;;
        find-links) uv_args+=(--find-links "$item") ;;
        constraint) uv_args+=(--constraints "$item") ;;
      esac
    done
  done < <("$py" -m pip config list 2>/dev/null)
}
install() {
  if use_uv && "$venv/bin/uv" pip install "${uv_args[@]}" "$@"; then
    return 0
  fi
  [ "${MILES_DISAGG_INSTALLER:-uv}" = "uv" ] && log "uv could not install $*; pip instead"
  pip_install "$@"
}

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
  install --no-deps --target "$tier_dir.partial" -r "$tier_req" "$torchvision"
  rm -rf "$tier_dir"
  mv "$tier_dir.partial" "$tier_dir"
}
use_uv || true  # once, before the two installs run side by side
tier_pid=""
if [ "$with_tier" = "1" ]; then
  install_sglang_tier &
  tier_pid=$!
fi

log "installing miles-disagg[$extras] (editable)"
install -e ".[$extras]"
if [ -n "$tier_pid" ] && ! wait "$tier_pid"; then
  log "the SGLang conformance tier did not install (MILES_DISAGG_SGLANG_TIER=0 skips it)"
  exit 1
fi

# The check that the environment imports also writes the byte code of what every run and every test
# process imports (torch, ray, the servers, the trainer, the loop): processes that start together
# then find it compiled, instead of each compiling it at once (about 6 s here).
env -u PYTHONDONTWRITEBYTECODE "$py" -c "
import torch, ray
import miles_disagg.cli, miles_disagg.engines.builtin.server, miles_disagg.fleet.manager, miles_disagg.loop.job
import miles_disagg.loop.train_loops, miles_disagg.rollout.manager, miles_disagg.router.app, miles_disagg.trainer.actor
import miles_disagg.trainer.fsdp
print(f'[setup] ready: torch {torch.__version__}')" >&2
echo "$want" > "$stamp"
