"""The trainer's typed configs: the policy trainer (``TrainConfig``: model, batch, optimizer, loss,
algorithms) and PPO's critic (``CriticConfig``), with the value sets of their flags. Field names are
miles' flag names with underscores; single-field range checks live in each ``__post_init__``
(``ValueError``); rules that span components live in ``validate.py``."""

from __future__ import annotations

from dataclasses import dataclass

from miles_disagg.config.field_checks import is_hook_path, require
from miles_disagg.config.fields import flag

TRAIN_BACKENDS = ("fsdp", "megatron")
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
MEGATRON_TO_HF_MODES = ("raw", "bridge")
MOE_DISPATCHERS = ("allgather", "alltoall", "flex")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
MOE_ROUTER_DTYPES = ("fp32", "fp64")
MOE_DROP_POLICIES = ("probs", "position")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
KL_LOSS_TYPES = ("low_var_kl", "k1", "k2", "k3")
OPTIMIZERS = ("adam",)
LR_DECAY_STYLES = ("constant",)
ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
CHECKPOINT_INITS = ("none", "tiny-qwen3", "tiny-qwen3-digits", "tiny-qwen3-moe", "tiny-qwen3-moe-digits")
LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")  # miles' --loss-type values
OPD_TYPES = ("sglang", "megatron")  # miles' --opd-type values


@dataclass(kw_only=True)
class TrainConfig:
    """The policy trainer: model, batch, optimizer and loss."""

    hf_checkpoint: str | None = flag(None, "HF checkpoint directory of the base policy (version 0).")
    train_hf_checkpoint: str | None = flag(None, "Full-precision HF checkpoint the trainer starts from when --hf-checkpoint is blockwise FP8 (what the engines serve; every version is published in its FP8 form). Default: --hf-checkpoint.")
    train_from_dequantized_checkpoint: bool = flag(False, "With a blockwise-FP8 --hf-checkpoint and no --train-hf-checkpoint: start the trainer from the FP8 weights dequantized (fsdp only).")
    hf_checkpoint_init: str = flag("none", "Create a random model at --hf-checkpoint when the directory is missing (tiny-qwen3: for CPU demos and tests; tiny-qwen3-moe: 4 experts, top 2).", choices=CHECKPOINT_INITS)
    train_backend: str = flag("megatron", "Training backend: megatron (as in miles) or fsdp (FSDP2 on GPU, data parallel over gloo on CPU).", choices=TRAIN_BACKENDS)
    loss_type: str = flag("policy_loss", "miles' loss: policy_loss (the policy-gradient loss of --advantage-estimator), sft_loss (negative log-likelihood of the trained tokens) or custom_loss (--custom-loss-function-path).", choices=LOSS_TYPES)
    custom_loss_function_path: str | None = flag(None, "miles: pkg.module.function with --loss-type custom_loss: fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics), in miles' layout.")
    custom_tis_function_path: str | None = flag(None, "miles: pkg.module.function replacing truncated IS (with --use-tis or --get-mismatch-metrics): fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs) -> (pg_loss, loss_masks, metrics).")
    custom_pg_loss_reducer_function_path: str | None = flag(None, "miles: pkg.module.function(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer of the policy term only (e.g. Dr.GRPO's constant divisor).")
    global_batch_size: int | None = flag(None, "Samples per optimizer step.")
    micro_batch_size: int = flag(1, "Samples per forward/backward pass.")
    use_dynamic_batch_size: bool = flag(False, "megatron: micro-batches by token budget (--max-tokens-per-gpu) instead of --micro-batch-size.")
    max_tokens_per_gpu: int | None = flag(None, "megatron with --use-dynamic-batch-size: most padded tokens per GPU in one micro-batch.")
    tensor_model_parallel_size: int = flag(1, "megatron: tensor-parallel size.")
    pipeline_model_parallel_size: int = flag(1, "megatron: pipeline-parallel size (needs CUDA).")
    context_parallel_size: int = flag(1, "megatron: context-parallel size (needs CUDA and Transformer Engine).")
    sequence_parallel: bool = flag(False, "megatron: sequence parallelism within the tensor-parallel group (needs CUDA).")
    recompute_granularity: str | None = flag(None, "megatron: activation recomputation, full or selective.", choices=RECOMPUTE_GRANULARITIES)
    recompute_method: str | None = flag(None, "megatron with --recompute-granularity full: uniform or block.", choices=RECOMPUTE_METHODS)
    recompute_num_layers: int | None = flag(None, "megatron with --recompute-granularity full: layers per recompute unit (uniform) or recomputed layers per stage (block).")
    expert_model_parallel_size: int = flag(1, "megatron: expert-parallel size (MoE models: the experts split over this many ranks; trains over gloo on CPU).")
    expert_tensor_parallel_size: int = flag(1, "megatron: expert tensor-parallel size (1 only: expert matrices are not split over TP here).")
    moe_grouped_gemm: bool | None = flag(None, "megatron MoE: grouped-GEMM experts (Transformer Engine's; needs CUDA and Transformer Engine).")
    moe_permute_fusion: bool | None = flag(None, "megatron MoE: fused token permutation (needs CUDA and Transformer Engine).")
    moe_token_dispatcher_type: str | None = flag(None, "megatron MoE: token dispatcher (unset: alltoall with --expert-model-parallel-size > 1, else allgather; both run on CPU over gloo; allgather is refused with EP > 1).", choices=MOE_DISPATCHERS)
    moe_router_load_balancing_type: str | None = flag(None, "megatron MoE: load-balancing loss type (unset: aux_loss, megatron's default).", choices=MOE_LOAD_BALANCING_TYPES)
    moe_aux_loss_coeff: float | None = flag(None, "megatron MoE: load-balancing loss weight (unset: 0.0, megatron's default; miles' Qwen3-MoE line passes 0).")
    moe_router_dtype: str | None = flag(None, "megatron MoE: router logits and softmax in this dtype (unset: the parameters' dtype).", choices=MOE_ROUTER_DTYPES)
    moe_token_drop_policy: str | None = flag(None, "megatron MoE: which tokens an expert over capacity drops (probs or position; only with a capacity factor, which is never set here).", choices=MOE_DROP_POLICIES)
    attention_dropout: float | None = flag(None, "megatron TransformerConfig.attention_dropout (unset: 0.0, not megatron's 0.1: RL logprobs must be the policy's).")
    hidden_dropout: float | None = flag(None, "megatron TransformerConfig.hidden_dropout (unset: 0.0, not megatron's 0.1).")
    attention_softmax_in_fp32: bool | None = flag(None, "megatron TransformerConfig.attention_softmax_in_fp32 (unset: on).")
    accumulate_allreduce_grads_in_fp32: bool | None = flag(None, "megatron: reduce and accumulate gradients in fp32 (DistributedDataParallelConfig.grad_reduce_in_fp32; unset: on; CPU runs are fp32 throughout).")
    attention_backend: str | None = flag(None, "megatron TransformerConfig.attention_backend (Transformer Engine layers on GPU; CPU runs use megatron's local attention).", choices=ATTENTION_BACKENDS)
    megatron_to_hf_mode: str = flag("raw", "How megatron weights become HF tensors: raw (this project's Qwen3 rules); bridge (megatron-bridge) is refused.", choices=MEGATRON_TO_HF_MODES)
    balance_data: bool = flag(False, "Deal each global batch so every trainer rank gets the same number of samples with similar token totals (instead of round robin).")
    num_steps_per_rollout: int | None = flag(None, "Optimizer steps per rollout: --global-batch-size = rollout samples // N.")
    use_rollout_logprobs: bool = flag(False, "Use the engines' logprobs (not the trainer's recomputed ones) as the PPO ratio's denominator.")
    use_rollout_routing_replay: bool = flag(False, "MoE: every engine call returns each token's routed experts (SGLang's return_routed_experts); the trainer replays them in forward and backward.")
    use_routing_replay: bool = flag(False, "MoE: the trainer replays a routing it recorded itself. fsdp: the rollout's first forward (before any optimizer step) records it and every training pass replays it; megatron: recomputed layers route as their forward did (no effect without --recompute-granularity). With --use-rollout-routing-replay the engines' routing is replayed instead.")
    optimizer: str = flag("adam", "Optimizer.", choices=OPTIMIZERS)
    lr: float = flag(1e-6, "Learning rate.")
    lr_decay_style: str = flag("constant", "Learning-rate schedule.", choices=LR_DECAY_STYLES)
    weight_decay: float = flag(0.0, "Decoupled weight decay (AdamW).")
    adam_beta1: float = flag(0.9, "Adam beta1.")
    adam_beta2: float = flag(0.999, "Adam beta2.")
    adam_eps: float = flag(1e-8, "Adam epsilon.")
    clip_grad: float = flag(1.0, "Clip the global gradient norm to this (0: off).")
    seed: int = flag(1234, "Random seed.")
    advantage_estimator: str = flag("grpo", "Advantage estimator: grpo, gspo (GRPO's advantages with GSPO's sequence-level ratio: the geometric mean of the token ratios, clipped per sequence), reinforce_plus_plus (discounted per-token returns), reinforce_plus_plus_baseline (group baseline), ppo (GAE over a critic's values; the critic trains in its own group, --critic-*).", choices=ADVANTAGE_ESTIMATORS)
    normalize_advantages_by_std: bool | None = flag(None, "Renamed: refused with a pointer to miles' --disable-grpo-std-normalization.")
    disable_grpo_std_normalization: bool = flag(False, "miles: GRPO advantages are reward minus the group's mean, not divided by the group's std (Dr. GRPO).")
    disable_rewards_normalization: bool = flag(False, "miles: no group normalization of the rewards at all (grpo, reinforce_plus_plus_baseline: the raw reward is the signal).")
    eps_clip_c: float | None = flag(None, "miles: dual-clip PPO lower bound (> 1): a negative-advantage token's loss is at most -eps_clip_c * advantage.")
    tis_clip_low: float = flag(0.0, "miles: lower clip of the TIS ratio (with --use-tis).")
    use_unbiased_kl: bool = flag(False, "miles: multiply the KL loss by the importance ratio exp(logprob - old logprob) (DeepSeek-V3.2's unbiased estimate).")
    normalize_advantages: bool = flag(False, "Whiten the per-token advantages over the rollout's trained tokens (all data-parallel ranks).")
    kl_coef: float = flag(0.0, "reinforce_plus_plus(_baseline), ppo: KL-to-reference penalty in the per-token reward (loads the reference; ppo: the policy's GAE rewards, not the critic's returns).")
    gamma: float = flag(1.0, "reinforce_plus_plus: discount of the per-token returns; ppo: GAE's discount.")
    lambd: float = flag(1.0, "miles: ppo: GAE's lambda (1: the discounted return minus the value; 0: one-step TD).")
    calculate_per_token_loss: bool = flag(False, "Loss = mean over the optimizer step's trained tokens (default: mean over samples of each sample's token mean).")
    eps_clip: float = flag(0.2, "PPO clip range (low side).")
    eps_clip_high: float | None = flag(None, "PPO clip range (high side; default: --eps-clip).")
    use_kl_loss: bool = flag(False, "Load the reference policy (the base checkpoint or --ref-load) and log train/kl_loss; add it to the loss with --kl-loss-coef.")
    kl_loss_coef: float = flag(0.0, "Weight of the KL loss (0: KL is logged, not trained on).")
    kl_loss_type: str = flag("k1", "KL estimator (miles' default k1): k1, k2, k3, or low_var_kl (k3 of the log-ratio clamped to [-20, 20], clamped to [-10, 10]).", choices=KL_LOSS_TYPES)
    entropy_coef: float = flag(0.0, "Weight of the entropy bonus.")
    ref_load: str | None = flag(None, "Reference model checkpoint (default: --hf-checkpoint).")
    use_tis: bool = flag(False, "Truncated importance sampling against the rollout policy's logprobs.")
    tis_clip: float = flag(2.0, "Upper clip of the TIS ratio.")
    use_opd: bool = flag(False, "miles: on-policy distillation: a teacher engine scores every sample's tokens (--opd-type sglang) and each token's advantage loses --opd-kl-coef x (student logprob - teacher logprob), before --normalize-advantages.")
    opd_type: str | None = flag(None, "miles: where the --use-opd teacher runs: sglang (an engine answering SGLang's /generate: --rm-url, or --opd-teacher-hf-checkpoint served by the job); megatron (inside the trainer) is refused.", choices=OPD_TYPES)
    opd_kl_coef: float = flag(1.0, "miles: weight of the --use-opd reverse KL subtracted from the advantages.")
    opd_teacher_load: str | None = flag(None, "miles: the teacher's Megatron checkpoint (--opd-type megatron, refused here; refused without --use-opd, as miles).")
    opd_teacher_ckpt_step: int | None = flag(None, "miles: the step of --opd-teacher-load (--opd-type megatron, refused here).")
    get_mismatch_metrics: bool = flag(False, "miles: report the trainer-vs-engine mismatch metrics of --custom-tis-function-path (which it needs; its correction applies too) and train/ois.")
    use_opsm: bool = flag(False, "miles: Off-Policy Sequence Masking: drop a negative-advantage sample's tokens when its mean old-minus-new logprob exceeds --opsm-delta.")
    opsm_delta: float = flag(1e-4, "miles: the --use-opsm threshold.")
    observe_training_entropy: bool = flag(False, "miles: log the training entropy with --entropy-coef 0 (train/entropy is always logged here).")
    disable_compute_advantages_and_returns: bool = flag(False, "miles: compute no advantages (for --loss-type sft_loss or custom_loss, whose batch then has none).")
    reset_optimizer_states: bool = flag(False, "miles: clear the optimizer's moments and step count after each rollout's training.")
    skip_actor_forward_only: bool = flag(False, "miles: skip the pass that recomputes the behaviour logprobs: the ratio's denominator is the engines' logprobs with --use-rollout-logprobs, else the training pass's own, detached (ratio exactly 1); needs one optimizer step per rollout and --train-backend megatron; refused with --loss-type sft_loss, --kl-coef or --use-opd (miles' rules).")
    lora_rank: int = flag(0, "miles: LoRA rank (0: full fine-tuning); --train-backend fsdp trains a PEFT adapter on the frozen base.")
    lora_alpha: int = flag(16, "miles: LoRA alpha: the adapter's update is scaled by alpha / rank.")
    lora_dropout: float = flag(0.0, "miles: dropout on the adapter's input while training.")
    target_modules: str | None = flag(None, "miles: LoRA targets, comma-separated: all-linear (the default: attention and MLP projections), the groups attn and mlp, or module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).")
    exclude_modules: str | None = flag(None, "miles: modules (names or groups, comma-separated) taken out of --target-modules.")
    lora_adapter_path: str | None = flag(None, "miles: warm start the adapter from a PEFT adapter directory (adapter_config.json, adapter_model.safetensors).")
    lora_train_only: bool = flag(False, "miles: train the adapter but roll out on the frozen base (every published version carries the base's weights).")
    load: str | None = flag(None, "Resume from the newest complete save in this directory (none there: start from --hf-checkpoint).")
    save: str | None = flag(None, "Save training checkpoints here (atomically: a half-written save is never loaded).")
    save_interval: int | None = flag(None, "Save every N rollouts (and at the end).")
    save_hf_interval: int | None = flag(None, "Also export the policy as an HF checkpoint every N rollouts (always at the end when --save is given).")
    max_trainer_restarts: int = flag(0, "Restart the trainer group from its last --save up to N times when a trainer rank dies or a trainer node is lost; the rollout goes on meanwhile (0: a trainer failure ends the run).")

    def __post_init__(self) -> None:
        require(self.micro_batch_size >= 1, "--micro-batch-size must be >= 1")
        require(self.global_batch_size is None or self.global_batch_size >= 1, "--global-batch-size must be >= 1")
        require(self.lr > 0, "--lr must be > 0")
        require(self.lora_rank >= 0, "--lora-rank must be >= 0")
        require(self.lora_alpha > 0, "--lora-alpha must be > 0")
        require(0 <= self.lora_dropout < 1, "--lora-dropout must be in [0, 1)")
        require(self.eps_clip > 0, "--eps-clip must be > 0")
        require(self.clip_grad >= 0, "--clip-grad must be >= 0")
        require(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "--adam-beta1/--adam-beta2 must be in [0, 1)")
        require(0 <= self.gamma <= 1, "--gamma must be in [0, 1]")
        require(0 <= self.lambd <= 1, "--lambd must be in [0, 1]")
        require(self.normalize_advantages_by_std is None,
                 "--(no-)normalize-advantages-by-std was this project's name; miles' names are used now: GRPO "
                 "divides by the group's reward std by default, --disable-grpo-std-normalization turns it off")
        require(self.eps_clip_c is None or self.eps_clip_c > 1, "--eps-clip-c (dual clip) must be > 1")
        require(0 <= self.tis_clip_low <= self.tis_clip, "--tis-clip-low must be in [0, --tis-clip]")
        require(self.kl_coef == 0 or self.advantage_estimator not in ("grpo", "gspo"),
                 "--kl-coef shapes the reward of reinforce_plus_plus(_baseline) and ppo only (miles' GRPO ignores it); "
                 "for GRPO use --use-kl-loss --kl-loss-coef")
        for dropout_flag, value in (("--attention-dropout", self.attention_dropout),
                                    ("--hidden-dropout", self.hidden_dropout)):
            require(value is None or 0 <= value < 1, f"{dropout_flag} must be in [0, 1)")
        require(self.num_steps_per_rollout is None or self.num_steps_per_rollout >= 1,
                 "--num-steps-per-rollout must be >= 1")
        for hook_flag, value in (("--custom-loss-function-path", self.custom_loss_function_path),
                                 ("--custom-tis-function-path", self.custom_tis_function_path),
                                 ("--custom-pg-loss-reducer-function-path", self.custom_pg_loss_reducer_function_path)):
            require(value is None or is_hook_path(value),
                     f"{hook_flag} must look like module.path.function or module.path:function, got {value!r}")

    @property
    def needs_reference(self) -> bool:
        """The reference model is loaded for the KL loss (whatever its coefficient) or the KL reward."""
        return self.use_kl_loss or self.kl_coef != 0


@dataclass(kw_only=True)
class CriticConfig:
    """PPO's critic (``--advantage-estimator ppo``): a value model (the policy's base model with a
    scalar value head) trained in its own trainer group; the batch and optimizer flags are the
    policy's (--global-batch-size, --micro-batch-size, --adam-*, --clip-grad), except its lr."""

    num_critic_only_steps: int = flag(0, "miles: the first N rollout steps train only the critic (value-function warmup); the policy stays as it is.")
    critic_load: str | None = flag(None, "miles: resume the critic from the newest save in this directory (default: --load with '_critic' appended); none there: a new value head on --hf-checkpoint.")
    critic_save: str | None = flag(None, "miles: save the critic here, whenever the policy is saved (default: --save with '_critic' appended).")
    critic_lr: float | None = flag(None, "miles: the critic's learning rate (default: --lr).")
    critic_lr_warmup_iters: int = flag(0, "miles: linear warmup of the critic's learning rate over its first N optimizer steps (Megatron's: step k trains with lr * k / N).")
    value_clip: float = flag(0.2, "miles: clip of the value loss: each new value may move at most this far from the value the rollout was scored with.")

    def __post_init__(self) -> None:
        require(self.num_critic_only_steps >= 0, "--num-critic-only-steps must be >= 0")
        require(self.critic_lr is None or self.critic_lr > 0, "--critic-lr must be > 0")
        require(self.critic_lr_warmup_iters >= 0, "--critic-lr-warmup-iters must be >= 0")
        require(self.value_clip > 0, "--value-clip must be > 0")
