"""Everything a run can check before Ray starts, in ``--dry-run`` and real runs alike.

Each check raises ``ConfigError`` naming the flag (exit 2, no traceback) for what would
otherwise fail later inside an actor: the prompt and eval data (exists, every record parses with
the configured keys, most of its text is in the tokenizer's vocabulary; a built-in ``task:NAME``
exists), the reward and the weight hooks (import, right signature; the rollout hooks are checked
by ``preflight.check_runnable``), the tracking backends asked for, the GPUs of this machine when a local Ray would run on them,
and the ``--sglang-*`` options (parsed by SGLang's own ``ServerArgs`` where SGLang is
importable). Attached engines are asked all at once: see :mod:`miles_disagg.loop.engine_probe`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from miles_disagg.config.components import RunConfig
from miles_disagg.config.critic_rules import uses_critic
from miles_disagg.rollout.data import MAX_LINE_BYTES as DATA_MAX_LINE_BYTES
from miles_disagg.tracking import status
from miles_disagg.types import ConfigError

MAX_LINE_BYTES = DATA_MAX_LINE_BYTES  # a longer "line" is not a prompt record (a binary file, a wrong path)
ANNOUNCED_MIB = 256  # a data file this large gets a line saying why the start waits (reading it takes a while)
TINY_INITS = {"tiny-qwen3": "full", "tiny-qwen3-digits": "digits",  # --hf-checkpoint-init -> charset
              "tiny-qwen3-moe": "full", "tiny-qwen3-moe-digits": "digits"}


def check_before_start(config: RunConfig, warnings: list[str] | None = None) -> None:
    """Every check of this module; the attached engines last (the only one that waits).

    ``warnings`` (``--dry-run``, which plans for a target machine): what this machine lacks but
    the target may have (its GPUs) goes there instead of failing, and so do the notes a real run
    prints as status lines (prompt text the tokenizer cannot encode)."""
    rollout = config.rollout
    if not rollout.debug_train_only:  # a run with engines reads them (its rollout manager does)
        check_prompt_data(config, warnings)
        check_reward(config)
    check_eval_data(config, warnings)
    check_weight_hooks(config)
    check_object_store(config)
    check_tracking_backends(config)
    try:
        check_local_gpus(config)
    except ConfigError as exc:
        if warnings is None:
            raise
        warnings.append(f"on this machine: {exc}")
    check_sglang_args(config)
    if warnings is not None:
        warnings += outputs_in_use(config)
    if rollout.debug_train_only:
        return
    from miles_disagg.loop.engine_probe import probe_engines, probe_service

    if rollout.rollout_service_url:
        probe_service(rollout.rollout_service_url)
    elif rollout.rollout_external:
        probe_engines(rollout.rollout_external_engine_addrs)


def check_object_store(config: RunConfig) -> None:
    """An ``s3://`` store answers this machine with its credentials (a list of one key under the
    prefix): wrong credentials, a missing bucket or an unreachable endpoint end the run here, one
    line naming the store and the cause (never a secret)."""
    from miles_disagg.types import MilesDisaggError
    from miles_disagg.weights.location import is_object_store, parse_object_url
    from miles_disagg.weights.s3_client import ObjectClient

    store = config.weights.update_weight_disk_dir
    if config.weights.update_weight_transfer_mode != "disk-delta" or not is_object_store(store):
        return
    location = parse_object_url(store, "--update-weight-disk-dir")
    try:
        ObjectClient(location, attempts=2, connect_timeout_s=3.0, read_timeout_s=10.0).check_bucket()
    except MilesDisaggError as exc:
        raise ConfigError(f"--update-weight-disk-dir: {exc}", ("--update-weight-disk-dir",)) from None


def check_prompt_data(config: RunConfig, notes: list[str] | None = None) -> None:
    rollout = config.rollout
    if rollout.prompt_data:
        check_jsonl(rollout.prompt_data, config, flag="--prompt-data", notes=notes)


def check_eval_data(config: RunConfig, notes: list[str] | None = None) -> None:
    for name, path in config.eval.datasets:
        if path.startswith("task:"):
            from miles_disagg.rollout.tasks import TASKS

            if path.removeprefix("task:") not in TASKS:
                raise ConfigError(f"--eval-prompt-data {name} {path!r}: no such built-in task; built-in tasks: "
                                  f"{sorted(TASKS)}", ("--eval-prompt-data",))
        else:
            check_jsonl(path, config, flag=f"--eval-prompt-data {name}", notes=notes)


def check_jsonl(path_text: str, config: RunConfig, *, flag: str, notes: list[str] | None = None) -> None:
    """Every record of the file, read as the rollout will read it (less the chat template's
    rendering), one at a time: the first bad one is a ``ConfigError`` naming the file, the line and
    what is wrong. Then the share of the prompt text the run's tokenizer cannot encode
    (:mod:`miles_disagg.loop.prompt_coverage`): most of it refused, some of it a note (to ``notes``
    where given, else a status line)."""
    from miles_disagg.loop.prompt_coverage import UnknownShare
    from miles_disagg.rollout.data import RecordKeys, prompt_records

    rollout = config.rollout
    path = Path(path_text)
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is not a file"
        raise ConfigError(f"{flag} {path_text!r} {what}", (flag.split()[0],))
    size_mib = path.stat().st_size / 2**20
    if size_mib >= ANNOUNCED_MIB:
        status(f"checking every record of {flag} {path_text} ({size_mib:.0f} MiB) before anything starts")
    vocabulary = _run_vocabulary(config)
    coverage = UnknownShare(vocabulary) if vocabulary is not None else None
    keys = RecordKeys(rollout.input_key, rollout.label_key, rollout.metadata_key)
    num_records = 0
    try:
        for record in prompt_records(path, keys, apply_chat_template=rollout.apply_chat_template, flag=flag,
                                     max_line_bytes=MAX_LINE_BYTES):
            num_records += 1
            if coverage is not None:
                coverage.add(record.text())
    except OSError as exc:
        raise ConfigError(f"{flag} {path_text!r}: cannot read ({exc.strerror or exc})", (flag.split()[0],)) from None
    if not num_records:
        raise ConfigError(f"{flag} {path_text!r} holds no records", (flag.split()[0],))
    note = coverage.verdict(flag) if coverage is not None else None
    if note is not None:
        notes.append(note) if notes is not None else status(f"note: {note}")


def _run_vocabulary(config: RunConfig):
    from miles_disagg.loop.prompt_coverage import run_vocabulary

    train = config.train
    made = None
    if train.hf_checkpoint_init in TINY_INITS:
        from miles_disagg.models.tiny_qwen3 import CHARSETS

        made = (train.hf_checkpoint_init, CHARSETS[TINY_INITS[train.hf_checkpoint_init]])
    return run_vocabulary(train.hf_checkpoint, made)


def check_reward(config: RunConfig) -> None:
    """The reward the rollout manager will make (``--custom-rm-path`` imported and signature-checked)."""
    from miles_disagg.rollout.prompts import make_reward

    make_reward(config.rollout)


def check_weight_hooks(config: RunConfig) -> None:
    """Import and signature-check the weight hooks, as the trainer and the engines' hosts will.
    (The rollout hooks are checked by ``preflight.check_runnable``.)"""
    from miles_disagg.weights.hooks import POST_WRITE_FLAG, PRE_READ_FLAG, load_hook

    load_hook(config.weights.custom_update_weight_post_write_path, POST_WRITE_FLAG)
    load_hook(config.weights.sglang_custom_pull_weights_pre_read_hook, PRE_READ_FLAG)


TRACKING_BACKENDS = (("use_tensorboard", "--use-tensorboard", "tensorboard", "tensorboard"),
                     ("use_wandb", "--use-wandb", "wandb", "wandb"))


def check_tracking_backends(config: RunConfig) -> None:
    """A backend asked for is installed (found, not imported: wandb alone takes seconds to import)."""
    for field, flag, module, package in TRACKING_BACKENDS:
        if getattr(config.tracking, field, False) and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{flag}: {package} is not installed (pip install '{package}', or the project's "
                              "'tracking' extra)", (flag,))


def check_local_gpus(config: RunConfig) -> None:
    """A local Ray offers this machine's CUDA devices (without CUDA: logical GPUs, one per bundle)
    and ``local_ray_num_cpus()`` CPUs; every bundle takes one GPU and one CPU, so the run must fit
    in them. (A cluster is asked once joined: ``job._check_cluster_offers``.)"""
    if os.environ.get("RAY_ADDRESS"):
        return
    from miles_disagg.loop.ray_start import cuda_device_count, local_ray_num_cpus
    from miles_disagg.trainer.placement import plan_layout

    layout = plan_layout(config.cluster, external_rollout=_external(config), critic=uses_critic(config))
    asked = (f"this run asks for {layout.num_bundles} bundles of 1 GPU + 1 CPU (trainer {len(layout.trainer)}: "
             "--actor-num-nodes x --actor-num-gpus-per-node; rollout "
             f"{layout.num_bundles - len(layout.trainer)}: --rollout-num-gpus)")
    flags = ("--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus")
    gpus, cpus = cuda_device_count(), local_ray_num_cpus()
    if gpus and layout.num_bundles > gpus:
        raise ConfigError(f"{asked}; this machine has {gpus} GPUs (set RAY_ADDRESS to run on a cluster)", flags)
    if layout.num_bundles > cpus:
        raise ConfigError(f"{asked}; a local Ray here offers {cpus} CPUs (set RAY_ADDRESS to run on a cluster)", flags)


def _external(config: RunConfig) -> bool:
    rollout = config.rollout
    return rollout.rollout_external or bool(rollout.rollout_service_url) or rollout.debug_train_only


def outputs_in_use(config: RunConfig) -> list[str]:
    """``--dry-run``: the directories the run would lock that another run appears to hold (a real
    run takes the locks and exits 2 naming the holder; a dry run only reads, so it warns)."""
    from miles_disagg.loop.run_lock import apparent_holder, describe, outputs_to_lock

    found = []
    for flag, path in outputs_to_lock(config):
        holder = apparent_holder(Path(os.path.abspath(path)))
        if holder is not None:
            found.append(f"{flag} {path} appears to be in use by another run ({describe(holder)}): a run started now "
                         "would exit 2 while that one holds it")
    return found


def check_sglang_args(config: RunConfig) -> None:
    """``--sglang-*`` options, parsed by SGLang's own ``ServerArgs`` where SGLang is importable:
    a typo exits 2 with the closest SGLang option instead of reaching SGLang's command line."""
    if not config.sglang_args or not _importable("sglang.srt.server_args"):
        return
    from miles_disagg.loop.sglang_check import parse_with_server_args, sglang_parser

    try:
        parser = sglang_parser()
    except Exception as exc:  # noqa: BLE001 - SGLang installed but broken here: said, not hidden
        from miles_disagg.tracking import status

        status(f"--sglang-* options not checked: SGLang's ServerArgs does not import here ({type(exc).__name__}: {exc})")
        return
    parse_with_server_args(config.sglang_args, parser)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False
