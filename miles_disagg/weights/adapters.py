"""LoRA adapter versions: the directory form PEFT and SGLang load, and its checks.

An adapter version directory holds ``adapter_config.json`` (``peft_type`` LORA, ``r``,
``lora_alpha``, ``target_modules``) and ``adapter_model.safetensors`` whose tensors carry PEFT's
saved names, ``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight``
(``[out, r]``), one pair per adapted module. Adapter versions travel through a version store like
any checkpoint: the initial adapter is the chain's version 0 (:func:`write_adapter_dir`, written
once), and every later version is a delta of its tensors against the one before, with the same
codec, lineage, checksums, anchors and hooks (:mod:`~miles_disagg.weights.publisher`,
:mod:`~miles_disagg.weights.materializer`). :func:`check_adapter_dir` is what a reader runs
before it loads one: a malformed or inconsistent directory is a ``FormatError`` naming what is
wrong, and nothing is loaded.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from miles_disagg.types import FormatError
from miles_disagg.weights.jsonio import load_json
from miles_disagg.weights.safetensors_io import checkpoint_tensors, fsync_dir, write_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
MAX_CONFIG_BYTES = 64 << 10
MAX_RANK = 1024
FLOAT_DTYPES = ("F32", "F16", "BF16")
_TENSOR_NAME = re.compile(r"^base_model\.model\.(?P<module>[A-Za-z0-9_.]+)\.lora_(?P<side>[AB])\.weight$")


@dataclass(frozen=True)
class AdaptedModule:
    """One adapted projection: ``module`` is its name in the base model (``model.layers.0.self_attn.q_proj``)."""

    module: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class AdapterInfo:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    modules: tuple[AdaptedModule, ...]
    dtype: str

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def write_adapter_dir(directory: str | Path, config: Mapping[str, Any], tensors: Mapping[str, Any]) -> Path:
    """Write an adapter directory whole (a staging directory renamed into place): ``tensors`` are
    ``{PEFT name: torch tensor}``. An existing directory is replaced only once the new one is durable."""
    import json

    from miles_disagg.weights.torch_bytes import dtype_code, tensor_bytes

    directory = Path(directory)
    staging = directory.parent / f".{directory.name}.{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        (staging / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2) + "\n")
        write_file(staging / ADAPTER_WEIGHTS, {name: (dtype_code(t.dtype), tuple(t.shape), tensor_bytes(t))
                                               for name, t in sorted(tensors.items())}, {"format": "pt"})
        fsync_dir(staging)
        check_adapter_dir(staging)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)
        fsync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def is_adapter_dir(directory: str | Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).exists()


def read_adapter_config(directory: Path) -> dict[str, Any]:
    path = directory / ADAPTER_CONFIG
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise FormatError(f"{path}: {size} bytes, more than an adapter config may hold ({MAX_CONFIG_BYTES})")
        config = load_json(path.read_bytes(), path)
    except OSError as exc:
        raise FormatError(f"{directory}: no readable {ADAPTER_CONFIG} ({exc.strerror})") from None
    if not isinstance(config, dict):
        raise FormatError(f"{path}: not a JSON object")
    return config


def _config_fields(config: dict[str, Any], where: Path) -> tuple[int, float, tuple[str, ...]]:
    if config.get("peft_type", "LORA") != "LORA":
        raise FormatError(f"{where}: peft_type {config.get('peft_type')!r}, only LORA adapters are served")
    rank, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_RANK:
        raise FormatError(f"{where}: r must be an integer in [1, {MAX_RANK}], got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise FormatError(f"{where}: lora_alpha must be a number > 0, got {alpha!r}")
    if (not isinstance(targets, list) or not targets
            or not all(isinstance(t, str) and t.isidentifier() for t in targets)):
        raise FormatError(f"{where}: target_modules must be a non-empty list of module names")
    for unsupported in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(unsupported):
            raise FormatError(f"{where}: {unsupported} adapters are not served")
    return rank, float(alpha), tuple(targets)


def check_adapter_dir(directory: str | Path) -> AdapterInfo:
    """The adapter a directory holds, after checking it whole; ``FormatError`` otherwise."""
    directory = Path(directory)
    rank, alpha, targets = _config_fields(read_adapter_config(directory), directory / ADAPTER_CONFIG)
    entries = checkpoint_tensors(directory)
    if set(f for f, _ in entries.values()) != {ADAPTER_WEIGHTS}:
        raise FormatError(f"{directory}: the adapter's tensors must all be in {ADAPTER_WEIGHTS}")
    sides: dict[str, dict[str, tuple[int, int]]] = {}
    dtypes = set()
    for name, (_, entry) in entries.items():
        match = _TENSOR_NAME.match(name)
        if match is None or match["module"].rsplit(".", 1)[-1] not in targets:
            raise FormatError(f"{directory}: tensor {name!r} is not a LoRA weight of target_modules {list(targets)}")
        if entry.dtype not in FLOAT_DTYPES or len(entry.shape) != 2:
            raise FormatError(f"{directory}: tensor {name!r} is {entry.dtype}{list(entry.shape)}, not a 2-D float")
        sides.setdefault(match["module"], {})[match["side"]] = entry.shape
        dtypes.add(entry.dtype)
    modules = []
    for module, pair in sorted(sides.items()):
        if set(pair) != {"A", "B"} or pair["A"][0] != rank or pair["B"][1] != rank:
            raise FormatError(f"{directory}: {module} needs lora_A [r, in] and lora_B [out, r] with r = {rank}, "
                              f"has {pair}")
        modules.append(AdaptedModule(module, pair["A"][1], pair["B"][0]))
    if not modules or len(dtypes) != 1:
        raise FormatError(f"{directory}: an adapter needs at least one module, all in one dtype")
    return AdapterInfo(rank, alpha, targets, tuple(modules), dtypes.pop())
