"""Before a run starts anything: what it needs beyond a valid config, the run directory, and the
base checkpoint (made on the spot for the tiny CPU models). ``--dry-run`` runs the same checks."""

from __future__ import annotations

import json
from pathlib import Path

from miles_disagg.config import RunConfig, config_to_dict
from miles_disagg.config.lora_rules import describe_lora
from miles_disagg.config.model_args import check_model_args
from miles_disagg.config.routing_replay import check_routing_replay
from miles_disagg.loop.preflight_checks import TINY_INITS, check_before_start
from miles_disagg.loop.quantized_base import check_quantized_base
from miles_disagg.tracking import status
from miles_disagg.trainer.torch_dist import check_backend_reads_torch_dist
from miles_disagg.types import ConfigError


def prepare_run(config: RunConfig) -> None:
    """Make the paths absolute, create the run directory, record the resolved config, and make
    the base checkpoint if asked."""
    make_paths_absolute(config)
    output_dir = Path(config.tracking.run_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.json").write_text(json.dumps(config_to_dict(config), indent=2) + "\n")
    status(f"run directory: {output_dir}")
    ensure_base_checkpoint(config)
    fp8_line = check_quantized_base(config)
    for line in (fp8_line, describe_lora(config)):
        if line:
            status(line)
    check_model_args(config)  # again: the checkpoint may have just been created
    check_routing_replay(config)  # likewise: is it a MoE?


PATH_FIELDS = {"tracking": ("run_dir",), "train": ("hf_checkpoint", "train_hf_checkpoint", "load", "save", "ref_load",
                                                 "lora_adapter_path"),
               "weights": ("update_weight_disk_dir", "update_weight_local_checkpoint_dir")}


def make_paths_absolute(config: RunConfig) -> None:
    """Paths the run hands to actors, resolved against the driver's working directory: an actor's
    own working directory differs (on another node, or under ``ray job submit``), and a path
    that means the same on every node must be absolute."""
    from miles_disagg.weights.location import normalize_store

    for section, names in PATH_FIELDS.items():
        component = getattr(config, section)
        for name in names:
            value = getattr(component, name)
            if value:  # a URL (an object store) keeps its canonical form, a directory becomes absolute
                setattr(component, name, normalize_store(value, f"--{name.replace('_', '-')}"))


def check_runnable(config: RunConfig, warnings: list[str] | None = None) -> None:
    """What a training run needs beyond a valid config (``--print-config`` does not need these);
    ``warnings``: see :func:`~miles_disagg.loop.preflight_checks.check_before_start`."""
    rollout, train = config.rollout, config.train
    for flag_name, value in (("--num-rollout", rollout.num_rollout), ("--rollout-batch-size", rollout.rollout_batch_size)):
        if value is None:
            raise ConfigError(f"{flag_name} is required to train", (flag_name,))
    from miles_disagg.rollout.sessions.agent import load_agent_function, load_matcher, rollout_hooks_of

    rollout_hooks_of(rollout)  # imported and signature-checked before anything starts
    if rollout.use_session_server:
        load_agent_function(rollout)  # the agent too, and a --session-message-matcher import path
        load_matcher(rollout.session_message_matcher)
    if train.custom_loss_function_path or train.custom_tis_function_path or train.custom_pg_loss_reducer_function_path:
        from miles_disagg.trainer.miles_loss_api import load_hooks

        load_hooks(train)  # likewise the loss hooks (imports torch, only when one is given)
    check_backend_reads_torch_dist(train.train_backend, train.load, train.ref_load)
    ranks = config.cluster.num_actor_gpus
    batch = train.global_batch_size or rollout.rollout_batch_size * rollout.n_samples_per_prompt
    if batch % ranks:
        raise ConfigError(f"--global-batch-size {batch} does not divide over {ranks} trainer ranks "
                          "(--actor-num-nodes x --actor-num-gpus-per-node)",
                          ("--global-batch-size", "--actor-num-gpus-per-node"))
    check_before_start(config, warnings)  # data, reward, hooks, tracking, GPUs, --sglang-*, attached engines


TINY_MOE_SHAPE = {"num_experts": 4, "num_experts_per_tok": 2}  # what the tiny-qwen3-moe inits add


def _tiny_shape(init: str) -> dict:
    return TINY_MOE_SHAPE if "-moe" in init else {}


def ensure_base_checkpoint(config: RunConfig) -> None:
    """Make the ``--hf-checkpoint-init`` model at ``--hf-checkpoint`` if the directory is missing.

    An existing directory is used only if it is exactly what the flags ask for (made with this
    ``--seed`` and charset): it is never replaced, since saves and published versions of
    earlier runs may build on it; a mismatch is a ``ConfigError`` saying what to do."""
    train = config.train
    if train.hf_checkpoint is None:
        raise ConfigError("--hf-checkpoint is required", ("--hf-checkpoint",))
    path = Path(train.hf_checkpoint)
    if path.is_dir():
        if train.hf_checkpoint_init in TINY_INITS:
            check_tiny_base(path, train.hf_checkpoint_init, train.seed)
        return
    if train.hf_checkpoint_init in TINY_INITS:
        from miles_disagg.models.tiny_qwen3 import CHARSETS, make_tiny_qwen3

        charset = CHARSETS[TINY_INITS[train.hf_checkpoint_init]]
        status(f"creating a random {train.hf_checkpoint_init} (seed {train.seed}) at {path}")
        staging = path.with_name(path.name + ".partial")
        make_tiny_qwen3(staging, seed=train.seed, charset=charset, **_tiny_shape(train.hf_checkpoint_init))
        staging.rename(path)  # a half-written base is never picked up
        return
    raise ConfigError(f"--hf-checkpoint {str(path)!r} is not a local directory", ("--hf-checkpoint",))


def check_tiny_base(path: Path, init: str, seed: int) -> None:
    """``ConfigError`` unless ``path`` was made as ``--hf-checkpoint-init init --seed seed`` makes it."""
    from miles_disagg.models.tiny_qwen3 import CHARSETS, INIT_RECORD_FILENAME, read_init_record, tiny_spec

    flags = ("--hf-checkpoint", "--hf-checkpoint-init", "--seed")
    asked = f"--hf-checkpoint-init {init} --seed {seed}"
    found = read_init_record(path)
    if found is None:
        raise ConfigError(f"--hf-checkpoint {str(path)!r} exists but has no {INIT_RECORD_FILENAME}, so it is not known "
                          f"to be what {asked} makes: drop --hf-checkpoint-init to train from it as it is, or remove "
                          "it to have it made", flags)
    expected = tiny_spec(seed=seed, charset=CHARSETS[TINY_INITS[init]], **_tiny_shape(init))
    differences = [f"{key} {_shown(key, found.get(key))} (this run asks for {_shown(key, value)})"
                   for key, value in expected.items() if found.get(key) != value]
    if differences:
        raise ConfigError(f"--hf-checkpoint {str(path)!r} was made with {', '.join(differences)}: it is not replaced "
                          "(saves and published versions may build on it); remove it, or point --hf-checkpoint "
                          "elsewhere", flags)


def _shown(key: str, value) -> str:
    if key == "charset" and isinstance(value, str):
        from miles_disagg.models.tiny_qwen3 import charset_name

        return charset_name(value)
    return repr(value)
