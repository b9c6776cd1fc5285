#!/usr/bin/env bash
# One prepared check of the GPU code paths on a single-GPU machine, printing ONE JSON object on
# stdout (progress on stderr); see miles_disagg/bench/gpu_check.py for the sections:
#   engine    the built-in engine on CUDA in bf16, Qwen3-0.6B-shaped random model: tokens/s at
#             concurrency 1 and 16, staged activation pause vs disk reload
#   fsdp      one FSDP2 training step on CUDA, and the train-vs-engine logprob difference
#   megatron  one megatron-core GPTModel step on CUDA (when megatron-core is importable)
#   delta     the disk-delta codec on a Qwen3-4B-shaped (~8 GB bf16) random model, every core
#   moe       a tiny Qwen3-MoE: the built-in engine returning routed experts (tokens/s, the routing
#             checked), one megatron step replaying them (skipped where this tree lacks either)
# Each section runs in its own process under its own time box (under 9 minutes in all); a failed
# section is reported with its error and the others still run. Exit 0 when every section is ok.
#
#   scripts/gpu_check.sh            on the GPU machine
#   scripts/gpu_check.sh --cpu      small shapes on the CPU (CI runs this)
#   scripts/gpu_check.sh --only engine,fsdp --work-dir /tmp/gc
#
# Needs: python with torch and transformers. Neither Ray nor SGLang. The other modules the check
# imports (safetensors, xxhash, zstandard, numpy, fastapi, uvicorn, httpx, pydantic) are taken
# from the environment, or installed without network from wheels in $MILES_DISAGG_WHEELS
# (default: gpu-wheels/ at the repo root, ignored by git) into a private directory. Make that
# folder where the network is (a few MiB; add the GPU machine's --python-version/--platform):
#   pip download -d gpu-wheels xxhash zstandard fastapi uvicorn httpx pydantic safetensors
# megatron-core is used when importable (its wheel may travel in the same folder: add
# megatron-core to the line above; it is installed only when it is in the folder).
# The project itself runs from the source tree (PYTHONPATH), not installed.
#   PYTHON                interpreter (default: python3)
#   MILES_DISAGG_WHEELS   folder of wheels to install missing modules from
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python_bin="${PYTHON:-python3}"
wheels="${MILES_DISAGG_WHEELS:-$root/gpu-wheels}"
deps_dir="${TMPDIR:-/tmp}/miles-disagg-gpu-check-deps"

missing="$("$python_bin" - <<'PY'
import importlib.util
modules = {"torch": "torch", "transformers": "transformers", "safetensors": "safetensors", "xxhash": "xxhash",
           "zstandard": "zstandard", "numpy": "numpy", "fastapi": "fastapi", "uvicorn": "uvicorn",
           "httpx": "httpx", "pydantic": "pydantic"}
print(" ".join(pkg for mod, pkg in modules.items() if importlib.util.find_spec(mod) is None))
PY
)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$missing" ]; then
  case " $missing " in *" torch "*|*" transformers "*)
    echo "gpu_check: torch and transformers must be installed (missing: $missing)" >&2; exit 2;;
  esac
  if [ ! -d "$wheels" ]; then
    echo "gpu_check: missing modules ($missing) and no wheel folder at $wheels (set MILES_DISAGG_WHEELS)" >&2
    exit 2
  fi
  echo "[gpu_check] installing $missing from $wheels into $deps_dir" >&2
  "$python_bin" -m pip install --quiet --no-index --find-links "$wheels" --target "$deps_dir" $missing >&2
  export PYTHONPATH="$PYTHONPATH:$deps_dir"
fi
if [ -d "$wheels" ] && ls "$wheels"/megatron_core-*.whl >/dev/null 2>&1 \
    && ! "$python_bin" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('megatron.core') is None)" 2>/dev/null; then
  echo "[gpu_check] installing megatron-core from $wheels into $deps_dir" >&2
  "$python_bin" -m pip install --quiet --no-index --no-deps --find-links "$wheels" --target "$deps_dir" megatron-core >&2
  case ":$PYTHONPATH:" in *":$deps_dir:"*) ;; *) export PYTHONPATH="$PYTHONPATH:$deps_dir";; esac
fi
exec "$python_bin" -m miles_disagg.bench.gpu_check "$@"
