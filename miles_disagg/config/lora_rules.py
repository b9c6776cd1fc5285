"""miles' LoRA flags (``--lora-rank`` and its group): which modules an adapter targets, and the
rules over the group. Each failure is one ``ConfigError`` line naming the flags.

Targets are the decoder's projections by their HF leaf names, the names PEFT's and SGLang's
``target_modules`` use: ``all-linear`` (miles' default) is every attention and MLP projection, the
groups ``attn`` and ``mlp`` are theirs, and names may be mixed with groups. The output head
(miles' ``unembed`` group, ``lm_head``) is refused: no engine here serves an adapter on it.
"""

from __future__ import annotations

from miles_disagg.types import ConfigError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_GROUPS = {"all-linear": ATTENTION_MODULES + MLP_MODULES, "attn": ATTENTION_MODULES, "mlp": MLP_MODULES}
UNSERVED_TARGETS = ("unembed", "lm_head", "embed_tokens")
LORA_FLAGS = ("--target-modules", "--exclude-modules", "--lora-adapter-path", "--lora-train-only")


def _names(value: str, flag_name: str) -> list[str]:
    """The comma-separated entries of a targets flag, each a known group or module name."""
    entries = [entry.strip() for entry in value.split(",")]
    if not all(entries):
        raise ConfigError(f"{flag_name} {value!r} has an empty entry; give comma-separated module names or groups",
                          (flag_name,))
    for entry in entries:
        if entry in UNSERVED_TARGETS:
            raise ConfigError(f"{flag_name} {entry}: adapters on the embeddings or the output head are not served by "
                              "any engine here; target the decoder's projections (all-linear, attn, mlp)",
                              (flag_name,))
        if entry not in TARGET_GROUPS and entry not in TARGET_GROUPS["all-linear"]:
            known = ", ".join((*TARGET_GROUPS, *TARGET_GROUPS["all-linear"]))
            raise ConfigError(f"{flag_name} {entry!r} is not a LoRA target here; known: {known}", (flag_name,))
    return entries


def _expand(entries: list[str]) -> list[str]:
    modules: list[str] = []
    for entry in entries:
        for module in TARGET_GROUPS.get(entry, (entry,)):
            if module not in modules:
                modules.append(module)
    return modules


def resolve_targets(target_modules: str | None, exclude_modules: str | None) -> tuple[str, ...]:
    """The module leaf names an adapter is put on, in the order attention then MLP."""
    targets = _names(target_modules or "all-linear", "--target-modules")
    excluded = _expand(_names(exclude_modules, "--exclude-modules")) if exclude_modules else []
    explicit = [t for t in targets if t not in TARGET_GROUPS]
    overlap = [t for t in explicit if t in excluded]
    if overlap:
        raise ConfigError(f"--target-modules names {overlap} and --exclude-modules takes them out (miles refuses this "
                          "too): drop them from one of the two", ("--target-modules", "--exclude-modules"))
    chosen = [m for m in _expand(targets) if m not in excluded]
    if not chosen:
        raise ConfigError("--exclude-modules takes out every module of --target-modules: no adapter is left",
                          ("--target-modules", "--exclude-modules"))
    order = TARGET_GROUPS["all-linear"]
    return tuple(sorted(chosen, key=order.index))


def check_lora_rules(config) -> None:
    """``ConfigError`` for the first invalid combination of a ``RunConfig``'s LoRA flags."""
    train = config.train
    if train.lora_rank == 0:
        given = [name for name, value in zip(LORA_FLAGS, (train.target_modules, train.exclude_modules,
                                                          train.lora_adapter_path, train.lora_train_only)) if value]
        if given:
            raise ConfigError(f"{given[0]} configures a LoRA adapter and --lora-rank is 0 (full fine-tuning): "
                              "give --lora-rank N (also when loading an adapter, as miles requires)",
                              (given[0], "--lora-rank"))
        return
    if train.train_backend != "fsdp":
        raise ConfigError(f"--lora-rank with --train-backend {train.train_backend}: this project's Megatron backend "
                          "trains full weights only; use --train-backend fsdp (a PEFT adapter on the frozen base)",
                          ("--lora-rank", "--train-backend"))
    resolve_targets(train.target_modules, train.exclude_modules)
    refusal = adapter_serving_refusal(config)
    if refusal is not None:
        raise ConfigError(*refusal)


def serves_adapters(config) -> bool:
    """Whether the run's engines serve its adapter versions: a LoRA run (not ``--lora-train-only``)
    publishing disk-delta versions through a directory or an object store, to engines this job
    launches or attached ones (vetted to serve adapter versions): built-in engines, or SGLang behind
    the agent; or a rollout service started with ``--lora-base-dir`` (checked before step 1). Every
    other LoRA topology is refused by :func:`adapter_serving_refusal`, never served
    the merged policy."""
    train, weights = config.train, config.weights
    return (train.lora_rank > 0 and not train.lora_train_only and adapter_serving_refusal(config) is None
            and weights.update_weight_transfer_mode == "disk-delta")


def adapter_serving_refusal(config) -> tuple[str, tuple[str, ...]] | None:
    """``(line, flags)`` when a LoRA run's engines could not serve its adapter versions (each case
    names what to use instead); None when they can, or when no adapter is served (full
    fine-tuning, ``--lora-train-only``: the engines roll out on the base)."""
    train, weights, cluster = config.train, config.weights, config.cluster
    if train.lora_rank == 0 or train.lora_train_only:
        return None
    engines = "use engines the job launches or attached ones (built-in, or SGLang behind the agent)"
    if cluster.colocate:
        return (f"--lora-rank with --colocate: colocated engines take the merged policy in memory, not adapter "
                f"versions; run disaggregated with --update-weight-transfer-mode disk-delta and {engines}, "
                "or --lora-train-only", ("--lora-rank", "--colocate"))
    if weights.update_weight_transfer_mode != "disk-delta":
        return (f"--lora-rank with --update-weight-transfer-mode {weights.update_weight_transfer_mode}: adapter "
                "versions travel through the version store (miles broadcasts merged weights); use "
                "--update-weight-transfer-mode disk-delta", ("--lora-rank", "--update-weight-transfer-mode"))
    if config.rollout.rollout_service_url and "://" in (weights.update_weight_disk_dir or ""):
        return ("--lora-rank with --rollout-service-url on an object store: this run keeps its adapter chain's version "
                "0 in the store, and the service's replicas read it from a directory (serve --lora-base-dir); use a "
                "directory store shared with the service, or engines the job launches or attached ones",
                ("--lora-rank", "--rollout-service-url", "--update-weight-disk-dir"))
    return None


def adapter_base_in_store(config) -> bool:
    """Whether the run's adapter chain's version 0 is in its object store (``s3://``): the trainer puts
    it there once and every engine fetches it onto its own node (``--lora-base-from-store``), as
    ``--rollout-base-from-store`` does the model's base. A directory store's is a path beside it."""
    return serves_adapters(config) and "://" in (config.weights.update_weight_disk_dir or "")


def adapter_base_dir(store_dir: str, run_dir: str | None = None) -> str:
    """Where an adapter-serving run's trainer writes its adapter chain's version 0: beside a directory
    store (the path the engines read), or for an object store (``s3://``) in the run directory, from
    where it goes into the store (:func:`adapter_base_in_store`): no engine reads that path."""
    if "://" in store_dir:
        if not run_dir:
            raise ConfigError(f"an adapter chain on {store_dir} needs a run directory for its version 0",
                              ("--update-weight-disk-dir",))
        return str(run_dir).rstrip("/") + "/lora-v0"
    return store_dir.rstrip("/") + ".lora-v0"


def describe_lora(config) -> str | None:
    """The run's one line about its adapter (None: full fine-tuning)."""
    train = config.train
    if train.lora_rank == 0:
        return None
    targets = ",".join(resolve_targets(train.target_modules, train.exclude_modules))
    if train.lora_train_only:
        served = "--lora-train-only: the adapter is trained and the engines roll out on the frozen base"
    else:  # every other topology is refused (adapter_serving_refusal)
        served = "the engines serve adapter versions beside the resident base, activated without a pause"
    return f"LoRA rank {train.lora_rank}, alpha {train.lora_alpha} on {targets}: {served}"
