"""Rules that span components. Run before anything starts; each failure names its flags."""

from __future__ import annotations

import re
from pathlib import Path

from miles_disagg.config.components import RunConfig
from miles_disagg.config.critic_rules import check_critic_rules
from miles_disagg.config.lora_rules import check_lora_rules
from miles_disagg.config.loss_rules import check_loss_rules
from miles_disagg.config.opd_rules import check_opd_rules
from miles_disagg.config.routing_replay import check_routing_replay
from miles_disagg.config.sglang_args import check_parallel_passthrough
from miles_disagg.config.session_rules import check_session_rules
from miles_disagg.config.miles_flags import miles_refusal
from miles_disagg.config.model_args import check_expert_layout, check_model_args
from miles_disagg.types import ConfigError

_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*):(\d{1,5})$")
MAX_ENGINE_ADDRESS_CHARS = 300
"""The longest engine address taken (``https://``, the longest host name DNS allows, ``:65535``, with room);
longer ones are refused as too long, here and wherever an address is named (``fleet/vetting.py``)."""


def validate(config: RunConfig) -> None:
    """Raise ``ConfigError`` (naming the offending flags) for the first invalid combination."""
    for check in (_check_entry, _check_miles_rejections, check_loss_rules, check_opd_rules, check_lora_rules,
                  _check_disk_delta,
                  _check_topology, _check_batches, _check_colocate, _check_debug, _check_save_and_eval, _check_megatron,
                  _check_megatron_only_flags, _check_routing, _check_ci, check_model_args, check_expert_layout,
                  _check_miles_logging_and_data, _check_offload, _check_trainer_restarts, _check_min_engines,
                  check_critic_rules, check_session_rules):
        check(config)
    check_routing_replay(config)  # MoE: the routing-replay flags need a MoE checkpoint
    launched = not (config.rollout.rollout_external or config.rollout.rollout_service_url)  # servers this job starts
    check_parallel_passthrough(config.sglang_args, config.cluster.rollout_num_gpus_per_engine if launched else None)


def parse_host_port(addr: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ``ValueError`` when malformed or too long."""
    if len(addr) > MAX_ENGINE_ADDRESS_CHARS:
        raise ValueError(f"engine address too long: {len(addr)} characters, at most {MAX_ENGINE_ADDRESS_CHARS} "
                         f"({addr[:60]!r}...)")
    match = _HOST_PORT.match(addr)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"malformed engine address {addr!r}: expected host:port with port 1-65535")
    return match.group(1).strip("[]"), int(match.group(2))


def _check_entry(config: RunConfig) -> None:
    if config.entry == "train_async" and config.cluster.colocate:
        raise ConfigError(
            "train_async.py (fully async rollout) needs separate trainer and rollout GPUs: "
            "drop --colocate or use train.py", ("--colocate",))
    if config.entry == "train" and config.rollout.fully_async:
        raise ConfigError("--fully-async needs train_async.py (miles refuses it in train.py too)", ("--fully-async",))
    if config.entry == "train_async" and config.rollout.pause_generation_mode == "abort":
        raise ConfigError("train_async.py keeps generation in flight, so --pause-generation-mode abort would kill it at "
                          "every weight update (miles refuses --fully-async with abort too): use retract or in_place",
                          ("--pause-generation-mode",))


def _check_miles_rejections(config: RunConfig) -> None:
    """Combinations miles itself refuses, with miles' reasons."""
    rollout, train = config.rollout, config.train
    if rollout.rollout_external and rollout.prefill_num_servers is not None:
        raise ConfigError("--prefill-num-servers cannot be combined with --rollout-external: attached engines' "
                          "prefill/decode split is theirs (miles refuses this too)",
                          ("--prefill-num-servers", "--rollout-external"))
    if train.use_rollout_logprobs and train.use_tis:
        raise ConfigError("--use-rollout-logprobs and --use-tis both correct for the rollout policy; give one "
                          "(miles refuses both at once too)", ("--use-rollout-logprobs", "--use-tis"))
    if train.megatron_to_hf_mode == "bridge":
        raise ConfigError(miles_refusal("--megatron-to-hf-mode bridge",
                                        "megatron-bridge conversion is not used; this project converts Qwen3 "
                                        "weights with its own rules", "use --megatron-to-hf-mode raw (the default)"),
                          ("--megatron-to-hf-mode",))
    _check_moe_refusals(train)


def _check_moe_refusals(train) -> None:
    """miles' MoE flags whose value this backend does not run, each with its reason."""
    size = train.expert_tensor_parallel_size
    if size != 1:
        raise ConfigError(miles_refusal(f"--expert-tensor-parallel-size {size}", "expert matrices are not split over "
                                        "tensor parallelism here (each expert-parallel rank holds whole experts)",
                                        "use --expert-tensor-parallel-size 1 and --expert-model-parallel-size to "
                                        "split the experts"), ("--expert-tensor-parallel-size",))
    if train.expert_model_parallel_size < 1:
        raise ConfigError(f"--expert-model-parallel-size must be >= 1, got {train.expert_model_parallel_size}",
                          ("--expert-model-parallel-size",))
    if train.moe_token_dispatcher_type == "flex":
        raise ConfigError(miles_refusal("--moe-token-dispatcher-type flex", "the flex dispatcher needs DeepEP or "
                                        "HybridEP, which this project does not install",
                                        "use --moe-token-dispatcher-type alltoall (or allgather)"),
                          ("--moe-token-dispatcher-type",))
    if train.moe_token_dispatcher_type == "allgather" and train.expert_model_parallel_size > 1:
        raise ConfigError("--moe-token-dispatcher-type allgather with --expert-model-parallel-size > 1: that dispatcher "
                          "gathers the same number of tokens from every EP rank, and RL micro-batches differ in "
                          "length between ranks; use alltoall (the default with EP > 1)",
                          ("--moe-token-dispatcher-type", "--expert-model-parallel-size"))
    if train.moe_router_load_balancing_type == "sinkhorn":
        raise ConfigError(miles_refusal("--moe-router-load-balancing-type sinkhorn", "Sinkhorn routing is not the "
                                        "top-k softmax routing Qwen3-MoE checkpoints (and the engines) use",
                                        "use aux_loss, seq_aux_loss, global_aux_loss or none"),
                          ("--moe-router-load-balancing-type",))


def _check_disk_delta(config: RunConfig) -> None:
    weights, train = config.weights, config.train
    if weights.update_weight_transfer_mode != "disk-delta":
        return
    mode = "--update-weight-transfer-mode disk-delta"
    if config.cluster.colocate:
        raise ConfigError(f"{mode} does not support --colocate (colocated jobs update in memory)",
                          ("--update-weight-transfer-mode", "--colocate"))
    if config.rollout.prefill_num_servers:
        raise ConfigError(f"{mode} does not support PD disaggregation (--prefill-num-servers)",
                          ("--update-weight-transfer-mode", "--prefill-num-servers"))
    for flag_name, value in (("--update-weight-disk-dir", weights.update_weight_disk_dir),
                             ("--update-weight-local-checkpoint-dir", weights.update_weight_local_checkpoint_dir)):
        if not value:
            raise ConfigError(f"{mode} requires {flag_name}", ("--update-weight-transfer-mode", flag_name))
    _check_store_url(weights.update_weight_disk_dir)
    if "://" in weights.update_weight_local_checkpoint_dir:
        raise ConfigError("--update-weight-local-checkpoint-dir is each engine host's own directory, not a URL",
                          ("--update-weight-local-checkpoint-dir",))
    _check_local_checkpoint(config)


def _check_store_url(store: str) -> None:
    """A store URL must be an ``s3://`` one (another scheme is refused, never taken for a path; the
    URL itself is parsed by preflight, in ``weights.location``)."""
    scheme = store.split("://", 1)[0] if "://" in store else None
    if scheme is not None and scheme != "s3":
        raise ConfigError(f"--update-weight-disk-dir {store[:200]!r}: the {scheme[:20]}:// scheme is not a version "
                          "store here: use a directory or s3://bucket/prefix", ("--update-weight-disk-dir",))


def _check_local_checkpoint(config: RunConfig) -> None:
    train = config.train
    if not train.hf_checkpoint:
        raise ConfigError("--update-weight-transfer-mode disk-delta requires --hf-checkpoint (the base version 0)",
                          ("--update-weight-transfer-mode", "--hf-checkpoint"))
    path = Path(train.hf_checkpoint)
    if train.hf_checkpoint_init != "none" and not path.exists():
        return  # created at start-up
    if not path.is_dir():
        raise ConfigError(
            f"--hf-checkpoint {train.hf_checkpoint!r} is not a local directory "
            "(disk-delta diffs against a local base checkpoint)", ("--hf-checkpoint",))


def _check_topology(config: RunConfig) -> None:
    rollout = config.rollout
    if rollout.rollout_external and rollout.rollout_service_url:
        raise ConfigError("--rollout-external and --rollout-service-url are different topologies; give one",
                          ("--rollout-external", "--rollout-service-url"))
    if rollout.rollout_service_url:
        _check_service(config)
    if config.cluster.rollout_node_resource and (rollout.rollout_external or rollout.rollout_service_url):
        other = "--rollout-external" if rollout.rollout_external else "--rollout-service-url"
        raise ConfigError(f"--rollout-node-resource places the engines this job launches; with {other} the engines "
                          "are placed by whoever runs them (for `serve ray`: its --replica-resource)",
                          ("--rollout-node-resource", other))
    if rollout.rollout_external_engine_addrs and not rollout.rollout_external:
        raise ConfigError("--rollout-external-engine-addrs needs --rollout-external",
                          ("--rollout-external-engine-addrs", "--rollout-external"))
    if not rollout.rollout_external:
        return
    if not rollout.rollout_external_engine_addrs:
        raise ConfigError("--rollout-external requires --rollout-external-engine-addrs host:port [host:port ...]",
                          ("--rollout-external", "--rollout-external-engine-addrs"))
    for addr in rollout.rollout_external_engine_addrs:
        try:
            parse_host_port(addr)
        except ValueError as exc:
            raise ConfigError(f"--rollout-external-engine-addrs: {exc}", ("--rollout-external-engine-addrs",)) from None


def _check_min_engines(config: RunConfig) -> None:
    """``--min-rollout-engines`` cannot ask for more engines than the run has (it would end the run
    after its timeout with every engine serving)."""
    rollout, cluster = config.rollout, config.cluster
    if rollout.rollout_service_url or rollout.debug_train_only:
        return
    if rollout.rollout_external:
        engines, source = len(rollout.rollout_external_engine_addrs), "--rollout-external-engine-addrs"
    else:
        engines = (cluster.rollout_num_gpus or cluster.num_actor_gpus) // cluster.rollout_num_gpus_per_engine
        source = "--rollout-num-gpus / --rollout-num-gpus-per-engine"
    if rollout.min_rollout_engines > engines:
        raise ConfigError(f"--min-rollout-engines {rollout.min_rollout_engines} is more than the {engines} engine(s) "
                          f"this run has ({source})", ("--min-rollout-engines",))


def _check_colocate(config: RunConfig) -> None:
    if not config.cluster.colocate:
        return
    if config.train.train_backend != "fsdp":
        raise ConfigError(f"--colocate offloads the trainer between rollouts, implemented for --train-backend fsdp "
                          f"only (got {config.train.train_backend}); drop --colocate or use fsdp",
                          ("--colocate", "--train-backend"))
    if config.rollout.rollout_external:
        raise ConfigError("--colocate shares this job's GPUs with engines it launches; attached engines "
                          "(--rollout-external) cannot be colocated", ("--colocate", "--rollout-external"))


def _check_batches(config: RunConfig) -> None:
    rollout, train = config.rollout, config.train
    if (rollout.over_sampling_batch_size is not None and rollout.rollout_batch_size is not None
            and rollout.over_sampling_batch_size < rollout.rollout_batch_size):
        raise ConfigError(f"--over-sampling-batch-size ({rollout.over_sampling_batch_size}) must be at least "
                          f"--rollout-batch-size ({rollout.rollout_batch_size})",
                          ("--over-sampling-batch-size", "--rollout-batch-size"))
    if rollout.rollout_batch_size is None or train.global_batch_size is None:
        return
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    if samples % train.global_batch_size:
        raise ConfigError(
            f"--rollout-batch-size x --n-samples-per-prompt ({samples}) must be a multiple of "
            f"--global-batch-size ({train.global_batch_size})",
            ("--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size"))


def _check_debug(config: RunConfig) -> None:
    rollout = config.rollout
    if rollout.debug_rollout_only and rollout.debug_train_only:
        raise ConfigError("--debug-rollout-only and --debug-train-only run opposite halves; give one",
                          ("--debug-rollout-only", "--debug-train-only"))
    if rollout.debug_train_only and not rollout.load_debug_rollout_data:
        raise ConfigError("--debug-train-only trains on saved rollouts: give --load-debug-rollout-data PATTERN",
                          ("--debug-train-only", "--load-debug-rollout-data"))
    for flag_name, value in (("--save-debug-rollout-data", rollout.save_debug_rollout_data),
                             ("--load-debug-rollout-data", rollout.load_debug_rollout_data)):
        if value and "{rollout_id}" not in value:
            raise ConfigError(f"{flag_name} {value!r} must contain {{rollout_id}} (one file per step)", (flag_name,))


def _check_save_and_eval(config: RunConfig) -> None:
    train, evaluation = config.train, config.eval
    for flag_name, value in (("--save-interval", train.save_interval), ("--save-hf-interval", train.save_hf_interval)):
        if value is not None and not train.save:
            raise ConfigError(f"{flag_name} needs --save DIR", (flag_name, "--save"))
        if value is not None and value < 1:
            raise ConfigError(f"{flag_name} must be >= 1", (flag_name,))
    if evaluation.eval_interval is not None and not evaluation.eval_prompt_data and not config.rollout.eval_function_path:
        raise ConfigError("--eval-interval needs --eval-prompt-data name path [name path ...] (or --eval-function-path)",
                          ("--eval-interval", "--eval-prompt-data"))
    if train.load and Path(train.load).exists() and not Path(train.load).is_dir():
        raise ConfigError(f"--load {train.load!r} is not a directory", ("--load",))


def _check_trainer_restarts(config: RunConfig) -> None:
    """``--max-trainer-restarts N``: a restarted trainer resumes from its last ``--save`` and
    catches the engines up through the version store, so it needs both."""
    train, flag_name = config.train, "--max-trainer-restarts"
    if train.max_trainer_restarts < 0:
        raise ConfigError(f"{flag_name} must be >= 0, got {train.max_trainer_restarts}", (flag_name,))
    if train.max_trainer_restarts == 0:
        return
    if not train.save:
        raise ConfigError(f"{flag_name} {train.max_trainer_restarts} needs --save DIR: a restarted trainer resumes "
                          "from its last save there (give --save-interval N to bound the steps run again)",
                          (flag_name, "--save"))
    if config.cluster.colocate or config.weights.update_weight_transfer_mode != "disk-delta":
        raise ConfigError(f"{flag_name} needs --update-weight-transfer-mode disk-delta without --colocate: a restarted "
                          "trainer reaches the engines through the version store (a broadcast group or a colocated "
                          "handoff cannot take in a new trainer)",
                          (flag_name, "--update-weight-transfer-mode", "--colocate"))


def _check_service(config: RunConfig) -> None:
    url = config.rollout.rollout_service_url or ""
    if not re.match(r"^https?://[^/\s]+(:\d+)?/?$", url):
        raise ConfigError(f"--rollout-service-url {url!r} must look like http://host:port", ("--rollout-service-url",))
    if config.weights.update_weight_transfer_mode != "disk-delta":
        raise ConfigError("--rollout-service-url needs --update-weight-transfer-mode disk-delta (the service's "
                          "replicas read published versions from the store)",
                          ("--rollout-service-url", "--update-weight-transfer-mode"))
    if not config.weights.update_weight_disk_dir:
        raise ConfigError("--rollout-service-url needs --update-weight-disk-dir: the version store the service reads",
                          ("--rollout-service-url", "--update-weight-disk-dir"))
    if config.cluster.colocate:
        raise ConfigError("--rollout-service-url cannot be colocated", ("--rollout-service-url", "--colocate"))


_MEGATRON_ONLY = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                  "--sequence-parallel", "--recompute-granularity", "--use-dynamic-batch-size")


def _check_megatron(config: RunConfig) -> None:
    """The megatron backend's parallel layout, recomputation and dynamic batch flags."""
    train = config.train
    sizes = {"--tensor-model-parallel-size": train.tensor_model_parallel_size,
             "--pipeline-model-parallel-size": train.pipeline_model_parallel_size,
             "--context-parallel-size": train.context_parallel_size}
    for flag_name, size in sizes.items():
        if size < 1:
            raise ConfigError(f"{flag_name} must be >= 1, got {size}", (flag_name,))
    if train.train_backend != "megatron":
        used = [name for name, value in zip(_MEGATRON_ONLY, (*sizes.values(), train.sequence_parallel,
                                                            train.recompute_granularity, train.use_dynamic_batch_size))
                if value not in (1, False, None)]
        if train.expert_model_parallel_size != 1:
            used.append("--expert-model-parallel-size")
        if used:
            raise ConfigError(f"{', '.join(used)}: megatron-only, but this run uses --train-backend "
                              f"{train.train_backend}", ("--train-backend", *used))
        return
    model_parallel = train.tensor_model_parallel_size * train.pipeline_model_parallel_size * train.context_parallel_size
    ranks = config.cluster.num_actor_gpus
    if ranks % model_parallel:
        raise ConfigError(f"{ranks} trainer GPUs (--actor-num-nodes x --actor-num-gpus-per-node) are not a multiple "
                          f"of TP x PP x CP = {model_parallel}", ("--actor-num-gpus-per-node", *sizes))
    expert_parallel = train.expert_model_parallel_size * train.pipeline_model_parallel_size
    if ranks % expert_parallel:
        raise ConfigError(f"{ranks} trainer GPUs (--actor-num-nodes x --actor-num-gpus-per-node) are not a multiple "
                          f"of --expert-model-parallel-size {train.expert_model_parallel_size} x "
                          f"--pipeline-model-parallel-size {train.pipeline_model_parallel_size}",
                          ("--actor-num-gpus-per-node", "--expert-model-parallel-size"))
    if train.expert_model_parallel_size > 1 and train.tensor_model_parallel_size > 1 and not train.sequence_parallel:
        raise ConfigError("--expert-model-parallel-size > 1 with --tensor-model-parallel-size > 1 needs "
                          "--sequence-parallel (megatron-core's rule)", ("--expert-model-parallel-size",
                                                                         "--tensor-model-parallel-size",
                                                                         "--sequence-parallel"))
    if train.sequence_parallel and train.tensor_model_parallel_size == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1",
                          ("--sequence-parallel", "--tensor-model-parallel-size"))
    if train.use_dynamic_batch_size and not (train.max_tokens_per_gpu or 0) >= 1:
        raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu N (N >= 1)",
                          ("--use-dynamic-batch-size", "--max-tokens-per-gpu"))
    _check_recompute(train.recompute_granularity, train.recompute_method, train.recompute_num_layers)


def _check_recompute(granularity: str | None, method: str | None, num_layers: int | None) -> None:
    flags = ("--recompute-granularity", "--recompute-method", "--recompute-num-layers")
    if granularity is None and (method is not None or num_layers is not None):
        raise ConfigError("--recompute-method/--recompute-num-layers need --recompute-granularity full", flags)
    if granularity == "full" and (method is None or num_layers is None or num_layers < 1):
        raise ConfigError("--recompute-granularity full needs --recompute-method (uniform|block) and "
                          "--recompute-num-layers N (N >= 1)", flags)
    if granularity == "selective" and (method is not None or num_layers is not None):
        raise ConfigError("--recompute-granularity selective takes no --recompute-method/--recompute-num-layers", flags)


_MEGATRON_CONFIG_FLAGS = (("--attention-dropout", "attention_dropout"), ("--hidden-dropout", "hidden_dropout"),
                          ("--attention-softmax-in-fp32", "attention_softmax_in_fp32"),
                          ("--accumulate-allreduce-grads-in-fp32", "accumulate_allreduce_grads_in_fp32"),
                          ("--attention-backend", "attention_backend"),
                          ("--moe-grouped-gemm", "moe_grouped_gemm"), ("--moe-permute-fusion", "moe_permute_fusion"),
                          ("--moe-token-dispatcher-type", "moe_token_dispatcher_type"),
                          ("--moe-router-load-balancing-type", "moe_router_load_balancing_type"),
                          ("--moe-aux-loss-coeff", "moe_aux_loss_coeff"), ("--moe-router-dtype", "moe_router_dtype"),
                          ("--moe-token-drop-policy", "moe_token_drop_policy"))


def _check_megatron_only_flags(config: RunConfig) -> None:
    """Megatron ``TransformerConfig`` flags mean nothing to the FSDP backend (the HF model as
    its config.json defines it): refused there rather than ignored."""
    train = config.train
    if train.train_backend == "megatron":
        return
    given = [flag_name for flag_name, field in _MEGATRON_CONFIG_FLAGS if getattr(train, field) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)}: megatron TransformerConfig flags, but --train-backend "
                          f"{train.train_backend} runs the HF model as its config.json defines it (no dropout, its own "
                          "attention kernels): drop them or use --train-backend megatron", ("--train-backend", *given))


def _check_routing(config: RunConfig) -> None:
    rollout = config.rollout
    if rollout.use_miles_router and rollout.router != "builtin":
        raise ConfigError("--use-miles-router asks for the job's own router, --router sglang for sglang-router: "
                          "give one", ("--use-miles-router", "--router"))
    if rollout.sglang_router_policy and rollout.router != "sglang":
        raise ConfigError("--sglang-router-policy sets sglang-router's policy, but this run routes with the built-in "
                          "version-aware router (least outstanding requests among engines that satisfy the version "
                          "constraint): add --router sglang or drop it", ("--sglang-router-policy", "--router"))
    if rollout.sglang_server_concurrency is not None and rollout.rollout_service_url:
        raise ConfigError("--sglang-server-concurrency is per engine, and the rollout service's engines are not "
                          "counted here: use --rollout-concurrency", ("--sglang-server-concurrency",
                                                                      "--rollout-service-url"))


def _check_ci(config: RunConfig) -> None:
    if config.ci.check_weight_update_equal and config.rollout.rollout_service_url:
        raise ConfigError("--check-weight-update-equal compares each engine's weights with the trainer's, but with "
                          "--rollout-service-url the run holds no engine (the service's replicas verify every "
                          "version's checksums before activating it)", ("--check-weight-update-equal",
                                                                        "--rollout-service-url"))


def _check_miles_logging_and_data(config: RunConfig) -> None:
    """miles' --disable-rollout-global-dataset where its meaning does not apply here."""
    rollout = config.rollout
    if rollout.disable_rollout_global_dataset and not rollout.rollout_function_path:
        raise ConfigError("--disable-rollout-global-dataset leaves the rollout without prompts unless a "
                          "--rollout-function-path manages its own data (as in miles): give one, or drop the flag",
                          ("--disable-rollout-global-dataset", "--rollout-function-path"))


def _check_offload(config: RunConfig) -> None:
    """miles' --offload flags: what --colocate does here (both sides offload); without --colocate, or turned
    off under it, refused with the reason."""
    cluster = config.cluster
    given = [(name, value) for name, value in (("--offload", cluster.offload or None),
                                               ("--offload-train", cluster.offload_train),
                                               ("--offload-rollout", cluster.offload_rollout)) if value is not None]
    for name, value in given:
        if value and not cluster.colocate:
            raise ConfigError(miles_refusal(name, "it frees one side's GPU memory while the other side of a colocated "
                                            "job runs, and this job is not colocated (the trainer and the engines "
                                            "have GPUs of their own)", "drop it, or add --colocate (which offloads "
                                            "both sides)"), (name,))
        if not value and cluster.colocate:
            off = "--no-" + name.removeprefix("--")
            raise ConfigError(miles_refusal(off, "a colocated job here always offloads both sides (the trainer "
                                            "between its steps, the engines while it trains)", "drop it"), (off,))
