"""Before a run starts: what a quantized ``--hf-checkpoint`` (blockwise FP8: what the engines serve)
needs. The trainer trains in full precision, from ``--train-hf-checkpoint`` (the checkpoint the FP8
one was converted from) or, when asked, from the FP8 weights dequantized; versions are published in
the FP8 form by the disk-delta publisher, the only transfer that knows it."""

from __future__ import annotations

import json
from pathlib import Path

from miles_disagg.config import RunConfig
from miles_disagg.models.fp8 import scheme_of, weight_name_of_scale
from miles_disagg.types import ConfigError
from miles_disagg.weights.safetensors_io import checkpoint_tensors

TRAIN_FLAG, DEQUANTIZE_FLAG = "--train-hf-checkpoint", "--train-from-dequantized-checkpoint"


def check_quantized_base(config: RunConfig) -> str | None:
    """``ConfigError`` naming the flags for what an FP8 base cannot do; a status line when it is FP8."""
    train = config.train
    base = Path(train.hf_checkpoint)
    scheme = scheme_of(_config_json(base), source=str(base / "config.json"))
    if scheme is None:
        given = [f for f, v in ((TRAIN_FLAG, train.train_hf_checkpoint), (DEQUANTIZE_FLAG, train.train_from_dequantized_checkpoint)) if v]
        if given:
            raise ConfigError(f"{given[0]} applies only to a quantized --hf-checkpoint; {base} is not quantized "
                              f"(the trainer starts from it)", (given[0], "--hf-checkpoint"))
        return None
    _refuse_other_transfers(config)
    if train.train_hf_checkpoint:
        _check_train_checkpoint(base, Path(train.train_hf_checkpoint))
    elif not train.train_from_dequantized_checkpoint:
        raise ConfigError(f"--hf-checkpoint {base} is blockwise FP8 (what the engines serve) and the trainer trains "
                          f"in full precision: give {TRAIN_FLAG} BF16_DIR (the checkpoint it was converted from), or "
                          f"{DEQUANTIZE_FLAG} to start from its dequantized weights", ("--hf-checkpoint", TRAIN_FLAG))
    elif train.train_backend != "fsdp":
        raise ConfigError(f"{DEQUANTIZE_FLAG} works with --train-backend fsdp; with {train.train_backend} give "
                          f"{TRAIN_FLAG} BF16_DIR", (DEQUANTIZE_FLAG, "--train-backend"))
    block = "x".join(map(str, scheme.block))
    return f"FP8 rollout: engines serve {base} (blockwise e4m3, {block}); every version is published in that form"


def _config_json(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc})", ("--hf-checkpoint",)) from None


def _refuse_other_transfers(config: RunConfig) -> None:
    if config.cluster.colocate:
        raise ConfigError("--colocate hands the trainer's full-precision tensors to the engines in memory; an FP8 "
                          "--hf-checkpoint needs the disk-delta path (drop --colocate)", ("--colocate", "--hf-checkpoint"))
    mode = config.weights.update_weight_transfer_mode
    if mode != "disk-delta":
        raise ConfigError(f"--update-weight-transfer-mode {mode} sends the trainer's full-precision tensors; with an "
                          f"FP8 --hf-checkpoint versions must be quantized as the engines load them: use disk-delta",
                          ("--update-weight-transfer-mode", "--hf-checkpoint"))


def _check_train_checkpoint(base: Path, train_dir: Path) -> None:
    """The full-precision checkpoint holds exactly the FP8 one's tensors (scales aside), same shapes."""
    if not (train_dir / "config.json").is_file():
        raise ConfigError(f"{TRAIN_FLAG} {train_dir} is not an HF checkpoint directory (no config.json)", (TRAIN_FLAG,))
    if scheme_of(_config_json(train_dir), source=str(train_dir / "config.json")) is not None:
        raise ConfigError(f"{TRAIN_FLAG} {train_dir} is quantized too; the trainer needs full-precision weights",
                          (TRAIN_FLAG,))
    served = {n: e.shape for n, (_, e) in checkpoint_tensors(base).items() if weight_name_of_scale(n) is None}
    trained = {n: e.shape for n, (_, e) in checkpoint_tensors(train_dir).items()}
    differ = sorted(n for n in served.keys() | trained.keys() if served.get(n) != trained.get(n))
    if differ:
        raise ConfigError(f"{TRAIN_FLAG} {train_dir} does not hold the model of --hf-checkpoint {base}: "
                          f"{len(differ)} tensors differ in name or shape, e.g. {differ[:3]}", (TRAIN_FLAG, "--hf-checkpoint"))

