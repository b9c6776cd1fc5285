"""The ``python -m sglang.launch_server`` command line for one managed SGLang engine.

Flag names are SGLang's own (``server_args.py``): ``--model-path``, ``--host``,
``--port``, ``--tp-size``, ``--base-gpu-id``, ``--dtype``, ``--weight-version``,
``--random-seed`` (each engine its own, derived from the job's ``--seed``), ``--trust-remote-code``. Anything else reaches SGLang through miles' passthrough
convention: a job flag ``--sglang-X [VALUE]`` becomes SGLang's ``--X [VALUE]``
(``--sglang-mem-fraction-static 0.8`` -> ``--mem-fraction-static 0.8``).

Passthrough values are ``str`` (one value), ``True`` (a bare switch), ``False`` (left
out) or a list of strings (a flag taking several values, e.g. ``--sglang-cuda-graph-bs
1 2 4``). A passthrough that names a flag this module sets itself is refused
(``ConfigError``): two values for the port or the TP size must never race.

The job's ``--sglang-*`` options are parsed in :mod:`miles_disagg.config.sglang_args`.

Pure: no I/O, no SGLang import (the command is built on machines without SGLang).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

from miles_disagg.config.sglang_args import PASSTHROUGH_PREFIX, PassthroughValue, sglang_flag_name
from miles_disagg.types import ConfigError

# SGLang's --dtype choices.
SGLANG_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")

# SGLang flags this module sets from typed arguments (with SGLang's own aliases).
MANAGED_FLAGS = frozenset({
    "model-path", "model", "host", "port", "tp-size", "tp", "tensor-parallel-size", "base-gpu-id",
    "dtype", "weight-version", "trust-remote-code", "random-seed",
})


LORA_FLAGS = frozenset({"enable-lora", "max-loras-per-batch", "max-loaded-loras", "max-lora-rank",
                        "lora-target-modules", "lora-paths"})


@dataclass(frozen=True)
class LoraServing:
    """SGLang's LoRA server args for an engine that serves a run's adapters (set by the launcher, so
    a ``--sglang-*`` passthrough of the same flags is refused)."""

    max_lora_rank: int
    target_modules: tuple[str, ...]
    max_loaded_loras: int = 4
    max_loras_per_batch: int = 4

    def argv(self) -> list[str]:
        if self.max_lora_rank < 1 or not self.target_modules or min(self.max_loaded_loras, self.max_loras_per_batch) < 1:
            raise ConfigError(f"SGLang LoRA serving needs a rank, targets and adapter counts >= 1, got {self}",
                              flags=("--lora-rank", "--target-modules"))
        return ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
                "--lora-target-modules", *self.target_modules,
                "--max-loaded-loras", str(self.max_loaded_loras), "--max-loras-per-batch", str(self.max_loras_per_batch)]


PLACEHOLDER = re.compile(r"^\{[a-z_]+\}$")
"""A value decided at launch on the engine's node (``{port}``, ``{base_gpu_id}``): ``--dry-run`` plans."""


def sglang_command(
    model_path: str, *, host: str, port: int | str, tp_size: int, base_gpu_id: int | str, dtype: str,
    weight_version: int | str, extra_args: Mapping[str, PassthroughValue] | None = None,
    trust_remote_code: bool = True, random_seed: int | None = None, python: str = sys.executable,
    lora: LoraServing | None = None,
) -> list[str]:
    """The argv that starts one SGLang server; ``ConfigError`` naming the flag for bad input.

    ``extra_args`` are passthrough options keyed by SGLang's flag name (``mem-fraction-static``;
    ``--`` prefix and underscores are accepted), as returned by :func:`miles_disagg.config.sglang_args.parse_sglang_passthrough`.
    ``trust_remote_code`` defaults to on, as miles launches SGLang. ``random_seed``: the engine's
    sampling seed (None: SGLang picks one at random). ``lora``: serve LoRA adapters (SGLang's
    ``--enable-lora`` and its group).
    """
    _check_managed(model_path, host, port, tp_size, base_gpu_id, dtype, weight_version)
    argv = [
        python, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--base-gpu-id", str(base_gpu_id),
        "--dtype", dtype,
        "--weight-version", str(weight_version),
    ]
    if random_seed is not None:
        if not _is_int(random_seed):
            raise ConfigError(f"SGLang --random-seed must be an int, got {random_seed!r}", flags=("--seed",))
        argv += ["--random-seed", str(random_seed)]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    if lora is not None:
        argv += lora.argv()
    for name, value in (extra_args or {}).items():
        if lora is not None and sglang_flag_name(name) in LORA_FLAGS:
            raise ConfigError(f"{PASSTHROUGH_PREFIX}{sglang_flag_name(name)} conflicts with the LoRA server args this "
                              "launcher sets from --lora-rank and --target-modules", flags=(f"{PASSTHROUGH_PREFIX}{name}",))
        argv += _passthrough_argv(name, value)
    return argv


def _check_managed(model_path: str, host: str, port: int, tp_size: int, base_gpu_id: int, dtype: str,
                   weight_version: int | str) -> None:
    if not str(model_path):
        raise ConfigError("the SGLang model path is empty", flags=("--hf-checkpoint",))
    if not host:
        raise ConfigError("the SGLang host is empty")
    if not _is_placeholder(port) and (not _is_int(port) or not 0 < port < 65536):
        raise ConfigError(f"SGLang port must be in 1..65535, got {port!r}")
    if not _is_int(tp_size) or tp_size < 1:
        raise ConfigError(f"--rollout-num-gpus-per-engine (SGLang --tp-size) must be >= 1, got {tp_size!r}",
                          flags=("--rollout-num-gpus-per-engine",))
    if not _is_placeholder(base_gpu_id) and (not _is_int(base_gpu_id) or base_gpu_id < 0):
        raise ConfigError(f"SGLang --base-gpu-id must be >= 0, got {base_gpu_id!r}")
    if dtype not in SGLANG_DTYPES:
        raise ConfigError(f"SGLang --dtype must be one of {', '.join(SGLANG_DTYPES)}, got {dtype!r}")
    if str(weight_version) == "":
        raise ConfigError("SGLang --weight-version is empty")


def _passthrough_argv(name: str, value: PassthroughValue) -> list[str]:
    flag = sglang_flag_name(name)
    if flag in MANAGED_FLAGS:
        raise ConfigError(
            f"{PASSTHROUGH_PREFIX}{flag} conflicts with a value this launcher sets itself (--{flag}); "
            "use the job's own flag instead", flags=(f"{PASSTHROUGH_PREFIX}{flag}",))
    if value is False:
        return []
    if value is True:
        return [f"--{flag}"]
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{PASSTHROUGH_PREFIX}{flag} needs one or more string values, got {value!r}",
                              flags=(f"{PASSTHROUGH_PREFIX}{flag}",))
        return [f"--{flag}", *value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # YAML configs give numbers
    if not isinstance(value, str):
        raise ConfigError(f"{PASSTHROUGH_PREFIX}{flag}: unsupported value {value!r}", flags=(f"{PASSTHROUGH_PREFIX}{flag}",))
    return [f"--{flag}", value]


def _is_placeholder(value: object) -> bool:
    return isinstance(value, str) and bool(PLACEHOLDER.match(value))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sglang_device_view(ray_gpu_ids: Sequence[str | int], node_visible: Sequence[str] | None,
                       tp_size: int = 1) -> tuple[int, str | None]:
    """``(--base-gpu-id, CUDA_VISIBLE_DEVICES)`` for an SGLang server started by a Ray actor.

    SGLang picks its ``tp_size`` GPUs as ``base_gpu_id, base_gpu_id + 1, ...`` among the
    devices it sees, so it must see the node's devices, not only the actor's one. Ray's GPU
    ids (``ray.get_gpu_ids()``) are entries of the node's ``CUDA_VISIBLE_DEVICES`` as the
    Ray worker found it (``node_visible``; None when it was unset: ids are physical indices).
    Where the node restricts its devices, SGLang keeps that restriction and the base is the
    position of the actor's first id in it; otherwise CUDA_VISIBLE_DEVICES is left unset
    (None) and the base is the id itself. ``ConfigError`` when the ids cannot be placed.
    """
    if not ray_gpu_ids:
        return 0, ",".join(node_visible) if node_visible is not None else None
    first = str(ray_gpu_ids[0]).strip()
    if node_visible is None:
        if not first.isdigit():
            raise ConfigError(f"Ray gave the engine GPU {first!r}, not an index, and CUDA_VISIBLE_DEVICES "
                              "is unset on its node; SGLang's --base-gpu-id needs an index")
        base, count = int(first), None
    else:
        visible = [v.strip() for v in node_visible]
        if first not in visible:
            raise ConfigError(f"Ray gave the engine GPU {first!r}, which is not in its node's "
                              f"CUDA_VISIBLE_DEVICES {','.join(visible)!r}")
        base, count = visible.index(first), len(visible)
    if count is not None and base + tp_size > count:
        raise ConfigError(f"SGLang with --tp-size {tp_size} from GPU {first!r} (position {base}) needs "
                          f"{tp_size} devices, the node shows {count} from there on: {','.join(node_visible)!r}",
                          flags=("--rollout-num-gpus-per-engine",))
    return base, ",".join(v.strip() for v in node_visible) if node_visible is not None else None
