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
    parses them). A flag given twice takes its last value, as every other flag of the job does
    and as miles and SGLang's own parser do (arguments appended to a script override the
    script's); so does an option given under two of its SGLang names (``--sglang-ep-size``, then
    ``--sglang-ep``): the last one given is kept.
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
        for earlier in _same_option(name):
            options.pop(earlier, None)  # the last value wins; the order kept is the order given
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


def _same_option(name: str) -> tuple[str, ...]:
    """``name`` and SGLang's other names of the same option (the aliases this module knows)."""
    return next((names for names in ALIASES if name in names), (name,))


def parse_sglang_passthrough(argv: Sequence[str]) -> dict[str, PassthroughValue]:
    """The ``--sglang-*`` options of ``argv`` keyed by SGLang flag name (see :func:`split_sglang_passthrough`)."""
    return split_sglang_passthrough(argv)[0]


def sglang_flag_name(name: str) -> str:
    """``mem_fraction_static`` / ``--mem-fraction-static`` / ``--sglang-mem-fraction-static`` -> ``mem-fraction-static``."""
    flag = name.removeprefix(PASSTHROUGH_PREFIX).lstrip("-").replace("_", "-")
    if not flag or flag.startswith("sglang-") or not all(c.isalnum() or c == "-" for c in flag):
        raise ConfigError(f"{name!r} is not an SGLang flag name")
    return flag


# --------------------------------------------------------------------------- MoE engines

EP_SIZE = ("ep-size", "expert-parallel-size", "ep")
DP_SIZE = ("dp-size", "data-parallel-size")
ATTN_DP_SIZE = ("attn-dp-size", "attention-data-parallel-size")
ROUTED_EXPERTS_FLAG = "enable-return-routed-experts"
ALIASES = (EP_SIZE, DP_SIZE, ATTN_DP_SIZE)  # names SGLang's parser takes for one option each


def check_parallel_passthrough(options: dict[str, PassthroughValue], gpus_per_engine: int | None) -> None:
    """``ConfigError`` for SGLang MoE parallel options that cannot fit one engine's GPUs.

    An engine gets ``--rollout-num-gpus-per-engine`` GPUs (SGLang's ``--tp-size``). Within them,
    ``--sglang-ep-size`` splits the experts (it must divide the engine's GPUs), and
    ``--sglang-dp-size N`` with ``--sglang-enable-dp-attention`` runs N attention data-parallel
    groups (N must divide them too; without ``--sglang-enable-dp-attention`` SGLang would start N
    whole replicas, N times the GPUs, and miles refuses it as well). ``--sglang-enable-return-
    routed-experts`` is set by ``--use-rollout-routing-replay``, which also makes the rollout ask
    for the routing and the trainer replay it. ``gpus_per_engine`` None: the job launches no SGLang
    server (attached engines, a rollout service), so only the last rule applies.
    """
    if ROUTED_EXPERTS_FLAG in options:
        raise ConfigError(f"{PASSTHROUGH_PREFIX}{ROUTED_EXPERTS_FLAG}: set by --use-rollout-routing-replay (which also "
                          "has the rollout keep the routing and the trainer replay it): use that instead",
                          (f"{PASSTHROUGH_PREFIX}{ROUTED_EXPERTS_FLAG}", "--use-rollout-routing-replay"))
    if gpus_per_engine is None:
        return
    for names, what in ((EP_SIZE, "expert-parallel groups"), (DP_SIZE, "attention data-parallel groups"),
                        (ATTN_DP_SIZE, "attention data-parallel groups")):
        size = _size_option(options, names)
        if size is not None and gpus_per_engine % size[1]:
            raise ConfigError(f"{PASSTHROUGH_PREFIX}{size[0]} {size[1]} must divide --rollout-num-gpus-per-engine "
                              f"{gpus_per_engine} (SGLang's --tp-size): an engine's GPUs are split into {what}",
                              (f"{PASSTHROUGH_PREFIX}{size[0]}", "--rollout-num-gpus-per-engine"))
    dp = _size_option(options, DP_SIZE)
    if dp is not None and dp[1] > 1 and options.get("enable-dp-attention") is not True:
        raise ConfigError(f"{PASSTHROUGH_PREFIX}{dp[0]} {dp[1]} needs {PASSTHROUGH_PREFIX}enable-dp-attention: without "
                          f"it SGLang starts {dp[1]} whole replicas on {dp[1]} x --rollout-num-gpus-per-engine GPUs "
                          "(miles refuses it too); use more engines instead",
                          (f"{PASSTHROUGH_PREFIX}{dp[0]}", f"{PASSTHROUGH_PREFIX}enable-dp-attention"))


def _size_option(options: dict[str, PassthroughValue], names: tuple[str, ...]) -> tuple[str, int] | None:
    """``(flag name, size)`` of the one of ``names`` given (SGLang's aliases of one option); None if none."""
    given = [name for name in names if name in options]
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError(f"{', '.join(PASSTHROUGH_PREFIX + n for n in given)} are one SGLang option: give one",
                          tuple(PASSTHROUGH_PREFIX + n for n in given))
    value = options[given[0]]
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{PASSTHROUGH_PREFIX}{given[0]} must be a positive integer, got {value!r}",
                          (f"{PASSTHROUGH_PREFIX}{given[0]}",))
    return given[0], int(text)
