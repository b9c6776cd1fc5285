"""The ``--sglang-*`` passthrough of a job's command line (miles' convention).

A job flag ``--sglang-X [VALUE]`` becomes SGLang's ``--X [VALUE]`` on every managed SGLang
server (``--sglang-mem-fraction-static 0.8`` -> ``--mem-fraction-static 0.8``); the
command line itself is built in :mod:`miles_disagg.engines.sglang`.

Values are ``str`` (one value), ``True`` (a bare switch), ``False`` (left out) or a list of
strings (a flag taking several values, e.g. ``--sglang-cuda-graph-bs 1 2 4``). Flags with
the prefix that this project consumes itself stay with the job: stock SGLang has no
``--custom-pull-weights-pre-read-hook``; that hook runs in ``miles-disagg agent``.

Pure: no I/O, no SGLang import.
"""

from __future__ import annotations

from typing import Sequence, Union

from miles_disagg.types import ConfigError

PASSTHROUGH_PREFIX = "--sglang-"

# Job flags that look like passthrough but belong to this project (never sent to SGLang).
CONSUMED_SGLANG_FLAGS = frozenset({"--sglang-custom-pull-weights-pre-read-hook"})

PassthroughValue = Union[str, bool, list[str]]


def split_sglang_passthrough(argv: Sequence[str], consumed: frozenset[str] = CONSUMED_SGLANG_FLAGS,
                             ) -> tuple[dict[str, PassthroughValue], list[str]]:
    """``(passthrough options, the rest of argv)``.

    ``--sglang-X=V`` and ``--sglang-X V`` give ``"V"``; ``--sglang-X V1 V2`` gives
    ``["V1", "V2"]`` (every following token up to the next ``--`` option; ``-1`` is a
    value); a bare ``--sglang-X`` gives ``True``. Flags in ``consumed`` (the job's own
    ``--sglang-*`` flags, e.g. miles' ``--sglang-router-port``) stay in the rest (the job
    parses them). A flag given twice is a ``ConfigError``.
    """
    consumed = consumed | CONSUMED_SGLANG_FLAGS
    options: dict[str, PassthroughValue] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        head = token.split("=", 1)[0]
        if not head.startswith(PASSTHROUGH_PREFIX) or head in consumed:
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


def sglang_flag_name(name: str) -> str:
    """``mem_fraction_static`` / ``--mem-fraction-static`` / ``--sglang-mem-fraction-static`` -> ``mem-fraction-static``."""
    flag = name.removeprefix(PASSTHROUGH_PREFIX).lstrip("-").replace("_", "-")
    if not flag or flag.startswith("sglang-") or not all(c.isalnum() or c == "-" for c in flag):
        raise ConfigError(f"{name!r} is not an SGLang flag name")
    return flag
