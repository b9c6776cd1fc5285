"""Typed per-component configs. Each actor receives its own config, never the whole namespace.

Field names are miles' flag names with underscores; defaults are miles' defaults
except where noted in the help text. Single-field range checks live in each
``__post_init__`` (``ValueError``); rules that span components live in ``validate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_disagg.config.field_checks import is_hook_path, is_resource_name, require
from miles_disagg.config.fields import flag
from miles_disagg.config.training import CriticConfig, TrainConfig

TRANSFER_MODES = ("broadcast", "disk-delta")
DELTA_ENCODINGS = ("xor", "overwrite")
DELTA_CHECKSUMS = ("xxh3-128", "blake3", "adler32")
DELTA_FILTERS = ("auto", "byteplane", "none")
PAUSE_MODES = ("abort", "retract", "in_place")
ROLLOUT_BACKENDS = ("auto", "builtin", "sglang")
ROUTERS = ("builtin", "sglang")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # what the built-in engine (and SGLang) accept
WANDB_MODES = ("online", "offline", "disabled")
OPD_TOP_K_STRATEGIES = ("only-student", "only-teacher", "intersection", "union", "xor")  # miles' --opd-top-k-strategy
OPD_REWARD_WEIGHT_MODES = ("student_p", "teacher_p", "none")  # miles' --opd-reward-weight-mode


@dataclass(kw_only=True)
class ClusterConfig:
    """Where the trainer and the rollout engines run (GPU counts are logical on a CPU machine)."""

    actor_num_nodes: int = flag(1, "Number of nodes for the training actor.")
    actor_num_gpus_per_node: int = flag(8, "Number of GPUs per node for the training actor.")
    rollout_num_gpus: int | None = flag(None, "Total GPUs for rollout engines (default: same as the actor's when colocated).")
    rollout_num_gpus_per_engine: int = flag(1, "GPUs per rollout engine (its tensor-parallel size).")
    colocate: bool = flag(False, "Share GPUs between training and rollout (they take turns); train.py only.")
    offload: bool = flag(False, "miles' --offload (= --offload-train --offload-rollout): what --colocate always does here; needs --colocate.")
    offload_train: bool | None = flag(None, "miles': offload the trainer (parameters, gradients, optimizer state) while the engines generate; always on with --colocate; needs --colocate.")
    offload_rollout: bool | None = flag(None, "miles': the engines release weights and KV cache while the trainer trains; always on with --colocate; needs --colocate.")
    num_gpus_per_node: int | None = flag(None, "GPUs per node (miles' flag): when given, --dry-run shows each bundle's node and a rollout engine may not span two nodes.")
    rollout_node_resource: str | None = flag(None, "Place engines only on nodes offering this Ray custom resource (e.g. one a rollout host was started with: ray start --resources '{\"rollout\": 8}'); each engine GPU asks for a share of it.", metavar="NAME")
    critic_num_nodes: int | None = flag(None, "miles: nodes of the critic (--advantage-estimator ppo; default: --actor-num-nodes).")
    critic_num_gpus_per_node: int | None = flag(None, "miles: GPUs per node of the critic (--advantage-estimator ppo; default: --actor-num-gpus-per-node); its bundles come after the trainer's.")

    def __post_init__(self) -> None:
        require(self.actor_num_nodes >= 1, "--actor-num-nodes must be >= 1")
        require(self.critic_num_nodes is None or self.critic_num_nodes >= 1, "--critic-num-nodes must be >= 1")
        require(self.critic_num_gpus_per_node is None or self.critic_num_gpus_per_node >= 1,
                 "--critic-num-gpus-per-node must be >= 1")
        require(self.num_gpus_per_node is None or self.num_gpus_per_node >= 1, "--num-gpus-per-node must be >= 1")
        require(self.actor_num_gpus_per_node >= 1, "--actor-num-gpus-per-node must be >= 1")
        require(self.rollout_num_gpus_per_engine >= 1, "--rollout-num-gpus-per-engine must be >= 1")
        require(self.rollout_num_gpus is None or self.rollout_num_gpus >= 1, "--rollout-num-gpus must be >= 1")
        require(self.rollout_node_resource is None or is_resource_name(self.rollout_node_resource),
                 f"--rollout-node-resource must name a custom resource, got {self.rollout_node_resource!r}")

    @property
    def num_actor_gpus(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_critic_gpus(self) -> int:
        """The critic's GPUs when the run has one (miles' defaults: the actor's counts)."""
        nodes = self.actor_num_nodes if self.critic_num_nodes is None else self.critic_num_nodes
        per_node = self.actor_num_gpus_per_node if self.critic_num_gpus_per_node is None else self.critic_num_gpus_per_node
        return nodes * per_node


@dataclass(kw_only=True)
class RolloutConfig:
    """Who owns the engines, how much to generate, and which policy versions samples may use."""

    rollout_external: bool = flag(False, "Attach engines launched outside this job (needs --rollout-external-engine-addrs).")
    rollout_external_engine_addrs: list[str] = flag([], "host:port of each attached engine.")
    rollout_service_url: str | None = flag(None, "One rollout-service endpoint (the service owns replicas and activation; needs --update-weight-disk-dir).")
    rollout_exact_version: bool = flag(False, "Ask for exactly the trainer's current version (evaluation-style on-policy rollout).")
    rollout_api_key: str | None = flag(None, "API key of the attached engines or the rollout service (sent as Bearer on generation; default: $MILES_DISAGG_API_KEY). Managed servers then require it too.")
    rollout_api_key_before_vetting: bool = flag(False, "Send --rollout-api-key (never the admin key) to an attached or added address whose /server_info answers 401 without a key, before it has shown it is an engine of this job (engines that guard their info endpoints, e.g. SGLang with --api-key). Off: such an address is refused.")
    rollout_admin_api_key: str | None = flag(None, "Admin key of the attached engines (weight updates) or the rollout service (/wake); default: $MILES_DISAGG_ADMIN_API_KEY, else the run generates one for the servers it starts.")
    rollout_backend: str = flag("auto", "Engine to launch when managed: builtin (the CPU engine), sglang, or auto (sglang when a GPU is present).", choices=ROLLOUT_BACKENDS)
    router: str = flag("builtin", "Router in front of the engines: builtin (version-aware) or sglang (sglang-router; no version constraints).", choices=ROUTERS)
    router_workers: int = flag(1, "Processes of the builtin router serving its one port (one probes and takes the registry calls, all route): more than 1 when one router process's core limits the rollout's requests per second.")
    rollout_health_check_interval: float = flag(1.0, "Seconds between health checks of each engine (the router's and the engine monitor's; miles' default is 30).")
    rollout_health_check_timeout: float = flag(10.0, "Seconds one engine health check may take before it counts as failed (miles' default is 30).")
    rollout_health_check_first_wait: float = flag(0.0, "Seconds after the engines started before the engine monitor's first check.")
    rollout_health_check_failure_threshold: int = flag(3, "Consecutive failed health checks before an engine counts as down (the router takes a worker out at once on a refused connection or an error status; a managed engine whose process exited is down at once).")
    use_fault_tolerance: bool = flag(False, "Restart a managed engine whose process died or failed its health checks, bring it to the current version, then route to it again (off: the run fails at the next weight update).")
    min_rollout_engines: int = flag(1, "End the run when fewer rollout engines than this serve for longer than --min-rollout-engines-timeout (engines of a lost node leave the router and are placed again when the cluster offers their resources; the run goes on with the rest meanwhile).")
    min_rollout_engines_timeout: float = flag(300.0, "Seconds a run may have fewer than --min-rollout-engines serving engines (a lost node coming back, or a new one, restores them) before it ends with one line.")
    use_miles_router: bool = flag(False, "miles' own router instead of sglang-router: here that is --router builtin (the version-aware router, the default).")
    sglang_router_port: int | None = flag(None, "Port the job's router listens on (default: a free port).")
    sglang_router_policy: str | None = flag(None, "sglang-router's routing policy (with --router sglang; unset: round_robin; e.g. cache_aware).")
    sglang_server_concurrency: int | None = flag(None, "Generation requests in flight per engine (miles' flag; sets --rollout-concurrency to this x the number of engines).")
    fully_async: bool = flag(False, "miles' fully async rollout: what train_async.py always does here (refused by train.py).")
    engine_dtype: str = flag("auto", "Weight dtype of managed built-in engines.", choices=ENGINE_DTYPES)
    num_rollout: int | None = flag(None, "Number of rollout/train iterations.")
    num_epoch: int | None = flag(None, "Passes over --prompt-data: --num-rollout = num_epoch x prompts // --rollout-batch-size (ignored when --num-rollout is given, as miles does).")
    rollout_batch_size: int | None = flag(None, "Prompts per rollout iteration.")
    n_samples_per_prompt: int = flag(1, "Samples generated per prompt (a GRPO group).")
    rollout_max_response_len: int = flag(1024, "Maximum new tokens per sample.")
    rollout_temperature: float = flag(1.0, "Sampling temperature.")
    rollout_top_p: float = flag(1.0, "Nucleus sampling threshold.")
    rollout_top_k: int = flag(-1, "Top-k sampling (-1: off).")
    rollout_stop: list[str] = flag([], "Stop strings of every rollout request (SGLang's sampling_params.stop).")
    rollout_stop_token_ids: list[int] = flag([], "Stop token ids of every rollout request (SGLang's sampling_params.stop_token_ids).")
    max_weight_staleness: int | None = flag(None, "Drop groups generated by a policy more than K versions older than the trainer's.")
    pause_generation_mode: str = flag("retract", "How engines pause for activation.", choices=PAUSE_MODES)
    prefill_num_servers: int | None = flag(None, "PD disaggregation: number of prefill servers (not supported with disk-delta).")
    task: str = flag("count-up", "Built-in procedural task with a rule reward, used when --prompt-data is not given.")
    prompt_data: str | None = flag(None, "JSONL prompt file.")
    input_key: str = flag("prompt", "Prompt field in --prompt-data.")
    label_key: str = flag("label", "Label field in --prompt-data.")
    metadata_key: str | None = flag(None, "Metadata field in --prompt-data (passed to the reward).")
    apply_chat_template: bool = flag(False, "Render prompts with the tokenizer's chat template.")
    rollout_shuffle: bool = flag(False, "Shuffle the prompts each epoch.")
    rm_type: str | None = flag(None, "Rule reward: math, deepscaler, or a built-in task's name (default: the task's).")
    custom_rm_path: str | None = flag(None, "module:function reward: this project's reward(prompt, response, label, metadata) -> float, or miles' async def reward_func(args, sample, **kwargs) -> number | dict.")
    reward_key: str | None = flag(None, "miles: the entry of a dict reward that is the trained reward.")
    eval_reward_key: str | None = flag(None, "miles: the entry of a dict reward used in evaluation (default: --reward-key).")
    group_rm: bool = flag(False, "miles: score each group with one call of --custom-rm-path's async reward_func(args, samples, **kwargs) -> list.")
    rollout_concurrency: int = flag(64, "Most generation requests in flight at once (all engines together).")
    custom_generate_function_path: str | None = flag(None, "pkg.module.function (or pkg.module:function): async generate(args, sample, sampling_params) -> Sample, called per sample instead of one batched request per group; may call the engines several times (multi-turn, tools).")
    use_session_server: bool = flag(False, "miles: agentic rollout through the run's session endpoint (POST /sessions, /sessions/{id}/v1/chat/completions: OpenAI chat, token-exact TITO trajectories); each sample is one session of --custom-agent-function-path's agent.")
    custom_agent_function_path: str | None = flag(None, "miles: pkg.module.function: async run_agent(base_url, prompt, request_kwargs, metadata) -> dict | None, called once per sample with its session's base_url (OpenAI routes under base_url/v1); the dict it returns is merged into the sample's metadata. Needs --use-session-server.")
    tito_model: str = flag("default", "miles: how a session's next prompt merges its stored token ids with the appended messages' tokens (default: concatenation; qwen3: the newline after <|im_end|>).")
    tito_allowed_append_roles: list[str] = flag(["tool"], "miles: roles a session may append after an assistant turn (tool, user, system; tool always).", metavar="ROLE")
    session_message_matcher: str = flag("strict", "miles: how the history a client sends back is matched against the session's stored messages (strict: equal roles, contents, tool calls and ids).")
    session_server_port: list[int] = flag([], "miles: the session endpoint's port (one instance here; none: a free port, shown in placement.json).", metavar="PORT")
    chat_template_path: str | None = flag(None, "miles: a .jinja chat template the session endpoint renders instead of the checkpoint's (a checkpoint without one gets a Qwen3-layout ChatML template).", metavar="FILE")
    rollout_function_path: str | None = flag(None, "pkg.module.function: async generate_rollout(args, rollout_id, data_source, evaluation=False) -> groups; replaces how a batch of groups is generated.")
    eval_function_path: str | None = flag(None, "pkg.module.function: async eval_rollout(args, rollout_id, data_source, evaluation=True) -> {name: {'rewards': [...], ...}}; replaces evaluation.")
    dynamic_sampling_filter_path: str | None = flag(None, "pkg.module.function: filter(args, samples) -> FilterOutput | bool, per completed group; a dropped group is replaced by a new one (miles_disagg.rollout.filters.check_reward_nonzero_std: DAPO's zero-variance filter).")
    over_sampling_batch_size: int | None = flag(None, "Groups drawn at a time while a batch is short of kept groups (train.py); groups in flight or buffered beyond one batch (train_async.py). Default: --rollout-batch-size.")
    buffer_filter_path: str | None = flag(None, "pkg.module.function: buffer_filter(args, rollout_id, buffer, num_samples) -> the groups to train on next (default: the oldest admissible).")
    rm_url: str | None = flag(None, "miles: with --use-opd --opd-type sglang, the teacher's /generate URL (http://HOST:PORT/generate; an SGLang server or a built-in engine with the student's vocabulary): each sample's tokens are scored there.", metavar="URL")
    opd_teacher_hf_checkpoint: str | None = flag(None, "With --use-opd --opd-type sglang instead of --rm-url: an HF checkpoint (the student's vocabulary) the job serves as the teacher, a built-in engine on the driver's host at version 0 (small teachers; start a large one as an SGLang server and give --rm-url).", metavar="DIR")
    opd_log_prob_top_k: int = flag(0, "miles: top-k on-policy distillation: each response position's reverse KL is taken over a set of K tokens (--opd-top-k-strategy) from the student's and/or the teacher's top-K logprobs (SGLang's top_logprobs_num / token_ids_logprob) instead of the sampled token alone; 0: sampled-token OPD.")
    opd_top_k_strategy: str = flag("only-student", "miles: the token set of top-k OPD per position: only-student (the student's top-K), only-teacher (the teacher's), intersection, union, xor.", choices=OPD_TOP_K_STRATEGIES)
    opd_reward_weight_mode: str = flag("student_p", "miles: how top-k OPD weighs each token of the set: student_p (the student's probability), teacher_p (the teacher's), none (uniform); normalized over the set, except with xor.", choices=OPD_REWARD_WEIGHT_MODES)
    opd_topk_per_position: bool = flag(False, "miles: ask the teacher (and the student) for each position's own token ids (token_ids_logprob_positions: the built-in engine answers it, stock SGLang needs miles' patch) instead of the union of every position's ids.")
    opd_teacher_urls: list[str] = flag([], "miles: several OPD teachers, NAME=URL each (URL: http://HOST:PORT/generate): a sample goes to the teacher named by its metadata[--opd-teacher-key], the name default taking samples with a missing or unknown name (none: such a sample fails the run); instead of --rm-url.", metavar="NAME=URL")
    opd_teacher_key: str = flag("opd_teacher", "miles: the sample metadata entry (from --metadata-key) naming its --opd-teacher-urls teacher.", metavar="FIELD")
    custom_reward_post_process_path: str | None = flag(None, "pkg.module.function: post_process(args, samples) -> (raw_rewards, rewards); the rewards become the samples' advantages (no further normalization).")
    debug_rollout_only: bool = flag(False, "Generate and score without training (no weight updates).")
    debug_train_only: bool = flag(False, "Train on --load-debug-rollout-data without engines.")
    save_debug_rollout_data: str | None = flag(None, "Write each step's groups to this path pattern ({rollout_id} is replaced).")
    load_debug_rollout_data: str | None = flag(None, "Read each step's groups from this path pattern instead of generating.")
    disable_rollout_global_dataset: bool = flag(False, "No global prompt dataset is sampled for rollout: the --rollout-function-path manages its own data (its data_source.get_samples is refused); needs --rollout-function-path.")

    def __post_init__(self) -> None:
        require(self.n_samples_per_prompt >= 1, "--n-samples-per-prompt must be >= 1")
        require(self.rollout_max_response_len >= 1, "--rollout-max-response-len must be >= 1")
        require(self.rollout_temperature >= 0, "--rollout-temperature must be >= 0")
        require(0 < self.rollout_top_p <= 1, "--rollout-top-p must be in (0, 1]")
        require(self.num_rollout is None or self.num_rollout >= 1, "--num-rollout must be >= 1")
        require(self.rollout_batch_size is None or self.rollout_batch_size >= 1, "--rollout-batch-size must be >= 1")
        require(self.max_weight_staleness is None or self.max_weight_staleness >= 0, "--max-weight-staleness must be >= 0")
        require(self.rollout_concurrency >= 1, "--rollout-concurrency must be >= 1")
        require(self.over_sampling_batch_size is None or self.over_sampling_batch_size >= 1, "--over-sampling-batch-size must be >= 1")
        require(self.rollout_health_check_interval > 0, "--rollout-health-check-interval must be > 0")
        require(self.rollout_health_check_timeout > 0, "--rollout-health-check-timeout must be > 0")
        require(self.rollout_health_check_first_wait >= 0, "--rollout-health-check-first-wait must be >= 0")
        require(self.rollout_health_check_failure_threshold >= 1, "--rollout-health-check-failure-threshold must be >= 1")
        require(self.min_rollout_engines >= 1, "--min-rollout-engines must be >= 1")
        require(self.min_rollout_engines_timeout >= 0, "--min-rollout-engines-timeout must be >= 0")
        require(self.num_epoch is None or self.num_epoch >= 1, "--num-epoch must be >= 1")
        require(self.sglang_server_concurrency is None or self.sglang_server_concurrency >= 1,
                 "--sglang-server-concurrency must be >= 1")
        require(self.sglang_router_port is None or 0 < self.sglang_router_port < 65536,
                 "--sglang-router-port must be in 1..65535")
        require(self.router_workers >= 1, "--router-workers must be >= 1")
        require(self.router_workers == 1 or self.router == "builtin",
                 "--router-workers applies to --router builtin (sglang-router runs its own threads)")


@dataclass(kw_only=True)
class WeightUpdateConfig:
    """How new policy versions travel from the trainer to the engines."""

    update_weight_transfer_mode: str = flag("broadcast", "Weight synchronization path.", choices=TRANSFER_MODES)
    update_weight_disk_dir: str | None = flag(None, "The version store (disk-delta): a directory shared by the trainer and rollout hosts, or s3://bucket/prefix on an S3-compatible object store (credentials from the AWS configuration).")
    update_weight_relay: list[str] = flag([], "REGION=URL: the miles-disagg relay of a region (object stores only, repeatable); that region's engines pull each version from it, so it crosses the WAN once per region.", metavar="REGION=URL")
    rollout_base_from_store: bool = flag(False, "The trainer puts --hf-checkpoint into the object store once (as its version 0) and managed engines fetch it from there: engine nodes need no copy of the base.")
    rollout_engine_regions: list[str] = flag([], "Region label of each managed engine in order (one label: every engine); names the relay an engine uses and the WAN bytes per region in the records.", metavar="REGION")
    update_weight_local_checkpoint_dir: str | None = flag(None, "Host-local checkpoint each rollout host materializes versions into (disk-delta).")
    update_weight_delta_encoding: str = flag("xor", "Delta encoding: xor (smallest, apply exactly once) or overwrite (idempotent).", choices=DELTA_ENCODINGS)
    update_weight_delta_checksum: str = flag("xxh3-128", "Final-state checksum of every changed tensor.", choices=DELTA_CHECKSUMS)
    update_weight_delta_filter: str = flag("auto", "Pre-compression filter: byteplane (2-byte dtypes as separate planes; only this project's engines and agents read it), none (the plain format every disk-delta consumer reads), or auto (byteplane when every consumer is a built-in engine or a miles-disagg agent, else none).", choices=DELTA_FILTERS)
    update_weight_buffer_size: int = flag(512 * 1024**2, "Broadcast mode: bytes of tensors per /update_weights_from_distributed call (miles' bucket size; disk-delta streams tensor by tensor).")
    update_weight_full_anchor_interval: int = flag(0, "Publish a full version every N versions so hosts can catch up and old versions can be pruned (0: off).")
    custom_update_weight_post_write_path: str | None = flag(None, "module:function run after a version's files are written, before the pointer moves.")
    sglang_custom_pull_weights_pre_read_hook: str | None = flag(None, "module:function run on a rollout host before it reads a version.")
    update_weights_interval: int = flag(1, "Update engine weights every N training steps (train_async.py).")

    def __post_init__(self) -> None:
        require(self.update_weight_full_anchor_interval >= 0, "--update-weight-full-anchor-interval must be >= 0")
        require(self.update_weights_interval >= 1, "--update-weights-interval must be >= 1")
        require(self.update_weight_buffer_size >= 1, "--update-weight-buffer-size must be >= 1")
        for relay in self.update_weight_relay:
            region, _, url = relay.partition("=")
            require(bool(region) and url.startswith(("http://", "https://")),
                    f"--update-weight-relay takes REGION=http(s)://host:port, got {relay[:200]!r}")
        require(len({r.partition("=")[0] for r in self.update_weight_relay}) == len(self.update_weight_relay),
                "--update-weight-relay names a region twice")
        require(not self.update_weight_relay or "://" in (self.update_weight_disk_dir or ""),
                "--update-weight-relay needs an object store (--update-weight-disk-dir s3://...): engines read a "
                "directory store directly")
        require(all(r and len(r) <= 64 for r in self.rollout_engine_regions), "--rollout-engine-regions: empty or too long label")
        require(not self.rollout_base_from_store or "://" in (self.update_weight_disk_dir or ""),
                "--rollout-base-from-store needs an object store (--update-weight-disk-dir s3://...)")
        for hook_flag, value in (
            ("--custom-update-weight-post-write-path", self.custom_update_weight_post_write_path),
            ("--sglang-custom-pull-weights-pre-read-hook", self.sglang_custom_pull_weights_pre_read_hook),
        ):
            require(value is None or is_hook_path(value),
                     f"{hook_flag} must look like module.path:function or module.path.function, got {value!r}")

    def relay_of(self, region: str) -> str | None:
        """The relay URL of ``region`` (``--update-weight-relay``), or None."""
        relays = dict(r.partition("=")[::2] for r in self.update_weight_relay)
        return relays.get(region)

    def region_of(self, index: int) -> str:
        """Managed engine ``index``'s region label ("" when none is given)."""
        regions = self.rollout_engine_regions
        return "" if not regions else regions[0] if len(regions) == 1 else regions[index] if index < len(regions) else ""


@dataclass(kw_only=True)
class ModelConfig:
    """Megatron model-architecture flags (miles' MODEL_ARGS). The architecture itself comes from
    --hf-checkpoint's config.json; each flag given is checked against it before anything starts."""

    swiglu: bool | None = flag(None, "SwiGLU MLP (config.json: hidden_act silu).")
    num_layers: int | None = flag(None, "Transformer layers (config.json: num_hidden_layers).")
    hidden_size: int | None = flag(None, "Hidden size (config.json: hidden_size).")
    ffn_hidden_size: int | None = flag(None, "MLP hidden size (config.json: intermediate_size).")
    num_attention_heads: int | None = flag(None, "Attention heads (config.json: num_attention_heads).")
    group_query_attention: bool | None = flag(None, "Grouped-query attention (config.json: num_key_value_heads < num_attention_heads).")
    num_query_groups: int | None = flag(None, "Key/value head groups (config.json: num_key_value_heads).")
    kv_channels: int | None = flag(None, "Channels per attention head (config.json: head_dim).")
    use_rotary_position_embeddings: bool | None = flag(None, "Rotary position embeddings (config.json: rope_theta present).")
    position_embedding_type: str | None = flag(None, "Position embedding type (config.json: rope for rope_theta).", choices=("rope", "learned_absolute", "none"))
    rotary_base: float | None = flag(None, "RoPE base (config.json: rope_theta).")
    disable_bias_linear: bool | None = flag(None, "No bias in linear layers (config.json: attention_bias false).")
    add_qkv_bias: bool | None = flag(None, "Bias in the QKV projection (config.json: attention_bias).")
    normalization: str | None = flag(None, "Normalization (config.json: rms_norm_eps means RMSNorm).", choices=NORMALIZATIONS)
    norm_epsilon: float | None = flag(None, "Normalization epsilon (config.json: rms_norm_eps).")
    qk_layernorm: bool | None = flag(None, "Norms on queries and keys (config.json: model_type qwen3).")
    vocab_size: int | None = flag(None, "Vocabulary size (config.json: vocab_size).")
    max_position_embeddings: int | None = flag(None, "Maximum positions (config.json: max_position_embeddings).")
    untie_embeddings_and_output_weights: bool | None = flag(None, "Separate output layer (config.json: tie_word_embeddings false).")
    rotary_percent: float | None = flag(None, "Fraction of each head's channels rotated by RoPE (config.json: partial_rotary_factor, 1.0 when absent).")
    num_experts: int | None = flag(None, "MoE experts per sparse layer (config.json: num_experts).")
    moe_router_topk: int | None = flag(None, "MoE experts per token (config.json: num_experts_per_tok).")
    moe_ffn_hidden_size: int | None = flag(None, "MoE expert hidden size (config.json: moe_intermediate_size).")
    moe_layer_freq: str | None = flag(None, "Which layers are MoE: N (every N-th from layer 0) or a list such as [1, 1, 0] (config.json: decoder_sparse_step, mlp_only_layers).")
    moe_shared_expert_intermediate_size: int | None = flag(None, "Shared-expert hidden size (config.json: shared_expert_intermediate_size; Qwen3-MoE has none).")
    moe_router_score_function: str | None = flag(None, "MoE router score function (config.json: softmax for Qwen3-MoE).", choices=("softmax", "sigmoid"))
    moe_router_pre_softmax: bool | None = flag(None, "MoE: softmax over all experts before top-k (config.json: norm_topk_prob false; true renormalizes the top-k, i.e. no pre-softmax).")
    moe_router_topk_scaling_factor: float | None = flag(None, "MoE: scale of the top-k routing weights (config.json: routed_scaling_factor, 1.0 when absent).")

    def given(self) -> dict[str, object]:
        """The flags that were set (field name -> value)."""
        return {name: value for name, value in vars(self).items() if value is not None}


@dataclass(kw_only=True)
class CIConfig:
    """miles' CI gates: checks that fail the run (exit 1, one line naming the gate) instead of logging."""

    ci_test: bool = flag(False, "miles' CI gates: fail the run (exit 1) when the first optimizer step of a rollout has |ppo_kl| >= 1e-8 or pg_clipfrac > 0, or when an engine does not serve the trainer's version after an update; also turns on --check-weight-update-equal (not in the debug modes nor with --rollout-service-url).")
    check_weight_update_equal: bool = flag(False, "After every weight update, compare each engine's per-tensor checksums with the trainer's published state; a difference fails the run.")
    ci_disable_kl_checker: bool = flag(False, "With --ci-test: skip the first-step ppo_kl / pg_clipfrac gate.")
    ci_disable_weight_update_checker: bool = flag(False, "With --ci-test: do not turn on --check-weight-update-equal.")


@dataclass(kw_only=True)
class EvalConfig:
    """Evaluation on held-out prompts with the exact current policy version (never trained on)."""

    eval_interval: int | None = flag(None, "Evaluate every N rollout steps (after the N-th, the 2N-th, ...) and after the last step.")
    eval_prompt_data: list[str] = flag([], "name path [name path ...]: JSONL files (or task:NAME for a built-in task).")
    n_samples_per_eval_prompt: int = flag(1, "Samples per eval prompt.")
    eval_temperature: float | None = flag(None, "Eval sampling temperature (default: --rollout-temperature).")
    eval_top_p: float | None = flag(None, "Eval nucleus threshold (default: --rollout-top-p).")
    eval_max_response_len: int | None = flag(None, "Eval max new tokens (default: --rollout-max-response-len).")
    eval_max_prompts: int = flag(256, "At most this many prompts of each eval set.")

    def __post_init__(self) -> None:
        require(self.eval_interval is None or self.eval_interval >= 1, "--eval-interval must be >= 1")
        require(self.n_samples_per_eval_prompt >= 1, "--n-samples-per-eval-prompt must be >= 1")
        require(len(self.eval_prompt_data) % 2 == 0, "--eval-prompt-data takes name path pairs")
        require(self.eval_max_prompts >= 1, "--eval-max-prompts must be >= 1")

    @property
    def datasets(self) -> list[tuple[str, str]]:
        items = self.eval_prompt_data
        return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]


@dataclass(kw_only=True)
class TrackingConfig:
    """Where metrics and progress go."""

    run_dir: str | None = flag(None, "Run directory: config.json (resolved), metrics.jsonl, summary.json, report.png, logs/; one run at a time (run.lock) (default: runs/<timestamp>-<random>).")
    use_tensorboard: bool = flag(False, "Also log metrics to TensorBoard (needs tensorboard installed).")
    use_wandb: bool = flag(False, "Also log metrics to Weights & Biases (needs wandb installed).")
    wandb_project: str | None = flag(None, "wandb project name.")
    wandb_group: str | None = flag(None, "wandb group name.")
    wandb_team: str | None = flag(None, "wandb entity (team) the run is logged under.")
    wandb_key: str | None = flag(None, "wandb API key (logged in with it; never printed or written to the run directory).")
    wandb_host: str | None = flag(None, "wandb server URL (logged in and logged to there).", metavar="URL")
    wandb_mode: str | None = flag(None, "wandb mode: online, offline (files only, no network; `wandb sync` uploads them later) or disabled (default: $WANDB_MODE, else online).", choices=WANDB_MODES)
    wandb_dir: str | None = flag(None, "Directory wandb writes its files under (default: the run directory).", metavar="DIR")
    wandb_run_id: str | None = flag(None, "Resume the wandb run with this id (created if it does not exist).", metavar="ID")
    disable_wandb_random_suffix: bool = flag(False, "Name the wandb run exactly --wandb-group (default: the group, else the run directory's name, plus '_' and 6 random characters).")
    tb_project_name: str | None = flag(None, "TensorBoard log root: events go to DIR/<--tb-experiment-name> (default: $TENSORBOARD_DIR, else <run-dir>/tensorboard).", metavar="DIR")
    tb_experiment_name: str | None = flag(None, "TensorBoard experiment: a subdirectory of --tb-project-name (default: the run directory's name).", metavar="NAME")
    log_passrate: bool = flag(False, "Log rollout/pass@k each step (k = 1, 2, 4, ... up to --n-samples-per-prompt; a sample passes when its reward is 1).")
    dump_details: str | None = flag(None, "Dump each step's groups for post-hoc analysis under DIR/rollout_data/ (sets --save-debug-rollout-data DIR/rollout_data/{rollout_id}.jsonl unless given).", metavar="DIR")


@dataclass(kw_only=True)
class RunConfig:
    """The resolved configuration of one run, one typed section per component."""

    entry: str = "train_async"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weights: WeightUpdateConfig = field(default_factory=WeightUpdateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ci: CIConfig = field(default_factory=CIConfig)
    sglang_args: dict = field(default_factory=dict)  # --sglang-* passthrough for managed SGLang servers


# flags whose values never reach config.json, --print-config, --dry-run or logs
SECRET_FIELDS = frozenset({"rollout_api_key", "rollout_admin_api_key", "wandb_key"})
REDACTED = "<redacted>"

# section name in RunConfig / YAML -> component class
SECTIONS: dict[str, type] = {
    "cluster": ClusterConfig,
    "rollout": RolloutConfig,
    "weights": WeightUpdateConfig,
    "train": TrainConfig,
    "critic": CriticConfig,
    "eval": EvalConfig,
    "tracking": TrackingConfig,
    "model": ModelConfig,
    "ci": CIConfig,
}
