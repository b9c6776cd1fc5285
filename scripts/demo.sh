#!/usr/bin/env bash
# Set up (if needed), then run the main job: the embedded CPU default.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
unset PYTHONDONTWRITEBYTECODE  # each module's byte code is written the first time it is imported (setup.sh)
exec .venv/bin/python train_async.py --config configs/tiny_cpu.yaml "$@"
