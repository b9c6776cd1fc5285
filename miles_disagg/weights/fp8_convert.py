"""``miles-disagg convert-fp8 --model-dir BF16 --save-dir FP8 [--block-size 128 128]``: a BF16 (or fp32)
HF checkpoint converted to blockwise FP8 as SGLang loads it, with the rule every FP8 version of a run
is published with (:mod:`miles_disagg.models.fp8`), so a version an engine applies equals this
command's output of the same weights, byte for byte.

Every ``*.safetensors`` file is converted tensor by tensor into a file of the same name (each FP8
weight followed by its ``weight_scale_inv``); the index's ``weight_map`` gains the scales;
``config.json`` gains ``quantization_config``; every other file (tokenizer, generation config) is
copied. The result is written into a staging directory beside ``--save-dir`` and renamed into place,
so ``--save-dir`` is absent, untouched, or complete. Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import REQUIRED, flag
from miles_disagg.types import InvalidInput
from miles_disagg.models.fp8 import BlockFp8, is_quantized_weight, quantize_named, scheme_of

INDEX_NAME = "model.safetensors.index.json"


class ConvertRefused(InvalidInput):
    """The model directory cannot be converted, or ``--save-dir`` is in the way; nothing was written."""


@dataclass(kw_only=True)
class ConvertFp8Command:
    """Convert an HF checkpoint to blockwise FP8 (the format SGLang serves with quant_method fp8)."""

    model_dir: Path = flag(REQUIRED, "The BF16/fp32 HF checkpoint directory to convert.")
    save_dir: Path = flag(REQUIRED, "The FP8 checkpoint directory to create.")
    block_size: list[int] = flag([128, 128], "FP8 block (rows cols) of each linear weight's scale.")
    force: bool = flag(False, "Replace a non-empty --save-dir.")

    def __post_init__(self) -> None:
        if len(self.block_size) != 2 or min(self.block_size) < 1:
            raise ValueError(f"--block-size takes two integers >= 1 (rows cols), got {self.block_size}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ConvertFp8Command)


def run(args: argparse.Namespace) -> int:
    command = config_from_args(ConvertFp8Command, args)
    summary = convert_checkpoint(command.model_dir, command.save_dir, BlockFp8(tuple(command.block_size)),
                                 force=command.force)
    print(json.dumps(summary))
    return 0


def convert_checkpoint(model_dir: Path, save_dir: Path, scheme: BlockFp8, *, force: bool = False) -> dict[str, Any]:
    """Write the FP8 conversion of ``model_dir`` to ``save_dir``; return what was converted."""
    config = _read_config(model_dir)
    _check_destination(save_dir, force)
    save_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{save_dir.name}.", suffix=".partial", dir=save_dir.parent))
    try:
        staging.chmod(0o755)
        counts = _convert_files(model_dir, staging, scheme)
        config["quantization_config"] = scheme.quantization_config()
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if save_dir.exists():
            shutil.rmtree(save_dir)
        staging.rename(save_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return {"save_dir": str(save_dir.resolve()), "weight_block_size": list(scheme.block), **counts}


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConvertRefused(f"--model-dir {str(model_dir)!r} has no config.json (not an HF checkpoint directory)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConvertRefused(f"--model-dir {str(model_dir)!r}: config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConvertRefused(f"--model-dir {str(model_dir)!r}: config.json is not an object")
    if scheme_of(config, source=str(path)) is not None:
        raise ConvertRefused(f"--model-dir {str(model_dir)!r} is already FP8 (config.json has a quantization_config)")
    if not any(model_dir.glob("*.safetensors")):
        raise ConvertRefused(f"--model-dir {str(model_dir)!r} has no *.safetensors files")
    return config


def _check_destination(save_dir: Path, force: bool) -> None:
    if save_dir.exists() and not save_dir.is_dir():
        raise ConvertRefused(f"--save-dir {str(save_dir)!r} exists and is not a directory")
    if save_dir.is_dir() and any(save_dir.iterdir()) and not force:
        raise ConvertRefused(f"--save-dir {str(save_dir)!r} is not empty; pass --force to replace it")


def _convert_files(model_dir: Path, out: Path, scheme: BlockFp8) -> dict[str, int]:
    from safetensors.torch import load_file, save_file

    weight_map: dict[str, str] = {}
    num_fp8 = num_kept = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(path)
        fused = [n for n, t in tensors.items() if n.endswith("_proj") and t.dim() == 3]
        if fused:
            raise ConvertRefused(f"{path.name}: fused expert tensors {fused[:2]}: save the checkpoint with "
                                 f"per-expert names (model.layers.N.mlp.experts.E.*_proj.weight) first")
        fp8_names = frozenset(n for n, t in tensors.items() if t.is_floating_point() and is_quantized_weight(n, t.shape))
        converted = dict(quantize_named(tensors.items(), scheme, fp8_names))
        save_file(converted, out / path.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(converted, path.name))
        num_fp8 += len(fp8_names)
        num_kept += len(tensors) - len(fp8_names)
    _copy_other_files(model_dir, out)
    if (model_dir / INDEX_NAME).is_file() or len(set(weight_map.values())) > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return {"num_fp8_weights": num_fp8, "num_kept_tensors": num_kept}


def _copy_other_files(model_dir: Path, out: Path) -> None:
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", INDEX_NAME):
            shutil.copy2(path, out / path.name)

