"""The ``python -m sglang.launch_server`` command line for one managed SGLang engine.

Flag names are SGLang's own (``server_args.py``): ``--model-path``, ``--host``,
``--port``, ``--tp-size``, ``--base-gpu-id``, ``--dtype``, ``--weight-version``,
``--trust-remote-code``. Anything else reaches SGLang through miles' passthrough
convention: a job flag ``--sglang-X [VALUE]`` becomes SGLang's ``--X [VALUE]``
(``--sglang-mem-fraction-static 0.8`` -> ``--mem-fraction-static 0.8``).

Passthrough values are ``str`` (one value), ``True`` (a bare switch), ``False`` (left
out) or a list of strings (a flag taking several values, e.g. ``--sglang-cuda-graph-bs
1 2 4``). A passthrough that names a flag this module sets itself is refused
(``ConfigError``): two values for the port or the TP size must never race.

Flags with the ``--sglang-`` prefix that this project consumes itself are not passed
on: stock SGLang has no ``--custom-pull-weights-pre-read-hook``; that hook runs in
``miles-disagg agent`` on the engine's host.

Pure: no I/O, no SGLang import (the command is built on machines without SGLang).
"""

from __future__ import annotations

import sys
from typing import Mapping, Sequence, Union

from miles_disagg.types import ConfigError

PASSTHROUGH_PREFIX = "--sglang-"

# SGLang's --dtype choices.
SGLANG_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")

# Job flags that look like passthrough but belong to this project (never sent to SGLang).
CONSUMED_SGLANG_FLAGS = frozenset({"--sglang-custom-pull-weights-pre-read-hook"})

# SGLang flags this module sets from typed arguments (with SGLang's own aliases).
MANAGED_FLAGS = frozenset({
    "model-path", "model", "host", "port", "tp-size", "tp", "tensor-parallel-size", "base-gpu-id",
    "dtype", "weight-version", "trust-remote-code",
})

PassthroughValue = Union[str, bool, list[str]]


def sglang_command(
    model_path: str, *, host: str, port: int, tp_size: int, base_gpu_id: int, dtype: str,
    weight_version: int | str, extra_args: Mapping[str, PassthroughValue] | None = None,
    trust_remote_code: bool = True, python: str = sys.executable,
) -> list[str]:
    """The argv that starts one SGLang server; ``ConfigError`` naming the flag for bad input.

    ``extra_args`` are passthrough options keyed by SGLang's flag name (``mem-fraction-static``;
    ``--`` prefix and underscores are accepted), as returned by :func:`parse_sglang_passthrough`.
    ``trust_remote_code`` defaults to on, as miles launches SGLang.
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
    if trust_remote_code:
        argv.append("--trust-remote-code")
    for name, value in (extra_args or {}).items():
        argv += _passthrough_argv(name, value)
    return argv


def _check_managed(model_path: str, host: str, port: int, tp_size: int, base_gpu_id: int, dtype: str,
                   weight_version: int | str) -> None:
    if not str(model_path):
        raise ConfigError("the SGLang model path is empty", flags=("--hf-checkpoint",))
    if not host:
        raise ConfigError("the SGLang host is empty")
    if not _is_int(port) or not 0 < port < 65536:
        raise ConfigError(f"SGLang port must be in 1..65535, got {port!r}")
    if not _is_int(tp_size) or tp_size < 1:
        raise ConfigError(f"--rollout-num-gpus-per-engine (SGLang --tp-size) must be >= 1, got {tp_size!r}",
                          flags=("--rollout-num-gpus-per-engine",))
    if not _is_int(base_gpu_id) or base_gpu_id < 0:
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


def sglang_flag_name(name: str) -> str:
    """``mem_fraction_static`` / ``--mem-fraction-static`` / ``--sglang-mem-fraction-static`` -> ``mem-fraction-static``."""
    flag = name.removeprefix(PASSTHROUGH_PREFIX).lstrip("-").replace("_", "-")
    if not flag or flag.startswith("sglang-") or not all(c.isalnum() or c == "-" for c in flag):
        raise ConfigError(f"{name!r} is not an SGLang flag name")
    return flag


# --------------------------------------------------------------------------- passthrough parsing


def split_sglang_passthrough(argv: Sequence[str]) -> tuple[dict[str, PassthroughValue], list[str]]:
    """``(passthrough options, the rest of argv)``.

    ``--sglang-X=V`` and ``--sglang-X V`` give ``"V"``; ``--sglang-X V1 V2`` gives
    ``["V1", "V2"]`` (every following token up to the next ``--`` option; ``-1`` is a
    value); a bare ``--sglang-X`` gives ``True``. Flags in ``CONSUMED_SGLANG_FLAGS`` stay
    in the rest (the job parses them). A flag given twice is a ``ConfigError``.
    """
    options: dict[str, PassthroughValue] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        head = token.split("=", 1)[0]
        if not head.startswith(PASSTHROUGH_PREFIX) or head in CONSUMED_SGLANG_FLAGS:
            rest.append(token)
            i += 1
            continue
        name = sglang_flag_name(head)
        if name in options:
            raise ConfigError(f"{head} is given twice", flags=(head,))
        if "=" in token:
            options[name] = token.split("=", 1)[1]
            i += 1
            continue
        values = []
        i += 1
        while i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        options[name] = True if not values else values[0] if len(values) == 1 else values
    return options, rest


def parse_sglang_passthrough(argv: Sequence[str]) -> dict[str, PassthroughValue]:
    """The ``--sglang-*`` options of ``argv`` keyed by SGLang flag name (see :func:`split_sglang_passthrough`)."""
    return split_sglang_passthrough(argv)[0]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
