#!/usr/bin/env bash
# The 8-GPU Qwen3-4B disk-delta run: a megatron trainer on GPUs 0-3 (TP 2 with sequence
# parallelism x CP 2, full recomputation, dynamic batches) and two SGLang engines on GPUs 4-7
# (TP 2 each), updated by --update-weight-transfer-mode disk-delta through train_async.py.
# tests/e2e/megatron/test_qwen3_4B_disk_delta.py runs this script; extra arguments are
# appended (the last value of a flag wins, --sglang-* flags included), e.g. --run-dir DIR or
# --sglang-mem-fraction-static 0.7.
#
# Needs: 8 CUDA GPUs, sglang, megatron-core with Transformer Engine (context parallelism),
# and local copies of the model and the prompts:
#   MILES_DISAGG_QWEN3_4B_DIR      a Qwen3-4B HF checkpoint directory (e.g. `hf download Qwen/Qwen3-4B`)
#   MILES_DISAGG_DAPO_MATH_JSONL   dapo-math-17k style JSONL: "prompt" (chat messages), "label" (answer)
#   MILES_DISAGG_QWEN3_4B_WORK_DIR run dir, publication dir and host-local checkpoint (default /tmp/miles-disagg-qwen3-4B)
#   PYTHON                         interpreter (default: .venv/bin/python, else python)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MILES_DISAGG_QWEN3_4B_DIR:?set MILES_DISAGG_QWEN3_4B_DIR to a local Qwen3-4B checkpoint directory}"
: "${MILES_DISAGG_DAPO_MATH_JSONL:?set MILES_DISAGG_DAPO_MATH_JSONL to a dapo-math-17k style JSONL file}"
work="${MILES_DISAGG_QWEN3_4B_WORK_DIR:-/tmp/miles-disagg-qwen3-4B}"
python_bin="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"

exec "$python_bin" train_async.py \
  --hf-checkpoint "$MILES_DISAGG_QWEN3_4B_DIR" \
  --train-backend megatron \
  --prompt-data "$MILES_DISAGG_DAPO_MATH_JSONL" --input-key prompt --label-key label \
  --apply-chat-template --rollout-shuffle --rm-type deepscaler \
  --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 2 \
  --rollout-max-response-len 100 --rollout-temperature 0.8 --global-batch-size 8 \
  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 \
  --context-parallel-size 2 \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --use-dynamic-batch-size --max-tokens-per-gpu 2048 \
  --advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 \
  --eps-clip 0.2 --eps-clip-high 0.28 \
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 \
  --adam-beta1 0.9 --adam-beta2 0.98 \
  --actor-num-nodes 1 --actor-num-gpus-per-node 4 \
  --rollout-backend sglang --rollout-num-gpus 4 --rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.8 \
  --update-weight-transfer-mode disk-delta \
  --update-weight-disk-dir "$work/weight-updates" \
  --update-weight-local-checkpoint-dir "$work/local-checkpoint" \
  --run-dir "$work/run" \
  "$@"
