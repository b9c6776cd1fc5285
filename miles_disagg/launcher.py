"""What ``train.py`` and ``train_async.py`` run: resolve the config, prepare, then train.

Exit codes: 0 done, 1 the run failed (one line naming the error; an unexpected internal
fault shows its traceback), 2 invalid configuration (a message naming the flags, no traceback).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

from miles_disagg.config import RunConfig, config_to_dict, config_to_yaml
from miles_disagg.config.loader import load_launch
from miles_disagg.config.model_args import check_model_args
from miles_disagg.trainer.torch_dist import check_backend_reads_torch_dist
from miles_disagg.tracking import status
from miles_disagg.types import ConfigError, MilesDisaggError

EXIT_FAILED = 1
EXIT_CONFIG_ERROR = 2


def main(entry: str, argv: Sequence[str] | None = None) -> int:
    """Entry point of ``train.py`` (entry="train") and ``train_async.py`` (entry="train_async")."""
    try:
        config, mode = load_launch(argv, entry)
        if mode == "print-config":
            print(config_to_yaml(config), end="")
            return 0
        if mode == "dry-run":
            from miles_disagg.loop.dry_run import plan_launch

            print(json.dumps(plan_launch(config), indent=2))
            return 0
        check_runnable(config)
        prepare_run(config)
        return run_training(config)
    except ConfigError as exc:
        print(f"{entry}.py: error: {_cause(exc)}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except MilesDisaggError as exc:
        print(f"{entry}.py: failed: {type(_cause(exc)).__name__}: {_cause(exc)}", file=sys.stderr)
        return EXIT_FAILED


def prepare_run(config: RunConfig) -> None:
    """Create the run directory, record the resolved config, and make the base checkpoint if asked."""
    output_dir = Path(config.tracking.run_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.json").write_text(json.dumps(config_to_dict(config), indent=2) + "\n")
    status(f"run directory: {output_dir}")
    ensure_base_checkpoint(config)
    check_model_args(config)  # again: the checkpoint may have just been created


def check_runnable(config: RunConfig) -> None:
    """What a training run needs beyond a valid config (``--print-config`` does not need these)."""
    rollout, train = config.rollout, config.train
    for flag_name, value in (("--num-rollout", rollout.num_rollout), ("--rollout-batch-size", rollout.rollout_batch_size)):
        if value is None:
            raise ConfigError(f"{flag_name} is required to train", (flag_name,))
    check_backend_reads_torch_dist(train.train_backend, train.load, train.ref_load)
    ranks = config.cluster.num_actor_gpus
    batch = train.global_batch_size or rollout.rollout_batch_size * rollout.n_samples_per_prompt
    if batch % ranks:
        raise ConfigError(f"--global-batch-size {batch} does not divide over {ranks} trainer ranks "
                          "(--actor-num-nodes x --actor-num-gpus-per-node)",
                          ("--global-batch-size", "--actor-num-gpus-per-node"))


def ensure_base_checkpoint(config: RunConfig) -> None:
    train = config.train
    if train.hf_checkpoint is None:
        raise ConfigError("--hf-checkpoint is required", ("--hf-checkpoint",))
    path = Path(train.hf_checkpoint)
    if path.is_dir():
        return
    if train.hf_checkpoint_init in ("tiny-qwen3", "tiny-qwen3-digits"):
        from miles_disagg.models.tiny_qwen3 import CHARSETS, make_tiny_qwen3

        charset = CHARSETS["digits" if train.hf_checkpoint_init.endswith("digits") else "full"]
        status(f"creating a random {train.hf_checkpoint_init} at {path}")
        staging = path.with_name(path.name + ".partial")
        make_tiny_qwen3(staging, seed=train.seed, charset=charset)
        staging.rename(path)  # a half-written base is never picked up
        return
    raise ConfigError(f"--hf-checkpoint {str(path)!r} is not a local directory", ("--hf-checkpoint",))


def run_training(config: RunConfig) -> int:
    from miles_disagg.loop.train_loops import run

    run(config)
    return 0


def _cause(exc: BaseException) -> BaseException:
    """The original error of one raised inside a Ray actor (Ray wraps it with its traceback)."""
    return getattr(exc, "cause", None) or exc
