#!/usr/bin/env bash
# The 16-GPU Qwen3-30B-A3B (MoE: 128 experts, top 8) disk-delta run: a megatron trainer on GPUs 0-7
# (TP 4 with sequence parallelism x EP 8, expert TP 1, full recomputation, dynamic batches; miles'
# scripts/models/qwen3-30B-A3B.sh model arguments) and one SGLang engine on GPUs 8-15 (TP 8 with
# expert parallelism 8 and DP attention), updated by --update-weight-transfer-mode disk-delta
# through train_async.py, with rollout routing replay (the engine returns each token's experts,
# the trainer replays them). tests/e2e/megatron/test_qwen3_30B_A3B_disk_delta.py runs this script;
# tests/e2e/test_miles_moe_launch_line.py dry-runs it on CPU. Extra arguments are appended (the
# last value of a flag wins, --sglang-* flags included; --sglang-expert-parallel-size replaces the
# --sglang-ep-size below, as SGLang takes both names for one option), e.g. --run-dir DIR or --dry-run.
#
# Needs: 16 CUDA GPUs, sglang, megatron-core with Transformer Engine (sequence parallelism,
# grouped-GEMM experts, fused permutation), and local copies of the model and the prompts:
#   MILES_DISAGG_QWEN3_30B_A3B_DIR      a Qwen3-30B-A3B HF checkpoint directory (`hf download Qwen/Qwen3-30B-A3B`)
#   MILES_DISAGG_DAPO_MATH_JSONL        dapo-math-17k style JSONL: "prompt" (chat messages), "label" (answer)
#   MILES_DISAGG_QWEN3_30B_A3B_WORK_DIR run dir, publication dir and host-local checkpoint (default /tmp/miles-disagg-qwen3-30B-A3B)
#   MODEL_ARGS_ROTARY_BASE              as in miles: 1000000 for Qwen3-30B-A3B (default), 10000000 for the 2507 models
#   PYTHON                              interpreter (default: .venv/bin/python, else python)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MILES_DISAGG_QWEN3_30B_A3B_DIR:?set MILES_DISAGG_QWEN3_30B_A3B_DIR to a local Qwen3-30B-A3B checkpoint directory}"
: "${MILES_DISAGG_DAPO_MATH_JSONL:?set MILES_DISAGG_DAPO_MATH_JSONL to a dapo-math-17k style JSONL file}"
work="${MILES_DISAGG_QWEN3_30B_A3B_WORK_DIR:-/tmp/miles-disagg-qwen3-30B-A3B}"
python_bin="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
moe_layer_freq="[$(printf '1, %.0s' $(seq 1 47))1]"  # 48 MoE layers (miles: FIRST_K_DENSE_REPLACE=0)

exec "$python_bin" train_async.py \
  --hf-checkpoint "$MILES_DISAGG_QWEN3_30B_A3B_DIR" \
  --train-backend megatron \
  --disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 32 --num-query-groups 4 \
  --kv-channels 128 --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 \
  --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 1.0 --swiglu \
  --untie-embeddings-and-output-weights --vocab-size 151936 --rotary-base "${MODEL_ARGS_ROTARY_BASE:-1000000}" \
  --moe-ffn-hidden-size 768 --moe-router-score-function softmax --moe-token-dispatcher-type alltoall \
  --moe-router-topk 8 --moe-layer-freq "$moe_layer_freq" --num-experts 128 --moe-grouped-gemm \
  --moe-token-drop-policy probs --moe-router-dtype fp32 --moe-permute-fusion --moe-aux-loss-coeff 0 \
  --prompt-data "$MILES_DISAGG_DAPO_MATH_JSONL" --input-key prompt --label-key label \
  --apply-chat-template --rollout-shuffle --rm-type deepscaler \
  --num-rollout 2 --rollout-batch-size 8 --n-samples-per-prompt 4 \
  --rollout-max-response-len 512 --rollout-temperature 0.8 --global-batch-size 32 \
  --tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1 \
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --use-dynamic-batch-size --max-tokens-per-gpu 20480 \
  --use-rollout-routing-replay \
  --advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 \
  --eps-clip 0.2 --eps-clip-high 0.28 \
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 \
  --adam-beta1 0.9 --adam-beta2 0.98 \
  --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 \
  --attention-backend flash \
  --actor-num-nodes 1 --actor-num-gpus-per-node 8 \
  --rollout-backend sglang --rollout-num-gpus 8 --rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.7 \
  --sglang-ep-size 8 --sglang-enable-dp-attention --sglang-dp-size 8 \
  --update-weight-transfer-mode disk-delta \
  --update-weight-disk-dir "$work/weight-updates" \
  --update-weight-local-checkpoint-dir "$work/local-checkpoint" \
  --run-dir "$work/run" \
  "$@"
