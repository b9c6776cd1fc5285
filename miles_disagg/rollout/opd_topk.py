"""Top-k on-policy distillation (miles' ``--opd-log-prob-top-k K``): the rules, no I/O.

Per response position ``t`` a token set ``S_t`` is formed from the student's top-K (its own
generation call's ``output_top_logprobs``, kept in ``Sample.metadata["opd_student_top_logprobs"]``)
and/or the teacher's top-K (``input_top_logprobs`` of the teacher's scoring call), by
``--opd-top-k-strategy``:

    only-student  S = student top-K          only-teacher  S = teacher top-K
    intersection  S = student ∩ teacher      union         S = student ∪ teacher
    xor           S = student △ teacher

Every token of ``S`` needs both logprobs: one side's come from its own top-K, the other side's from
a call that scores given token ids (SGLang's ``token_ids_logprob``, answered in
``input_token_ids_logprobs``): the teacher scores the student's ids (only-student, union, xor) and
the student's engines score the teacher's (only-teacher, union, xor). The position's term is

    reverse_kl_t = sum over v in S of w_v * (student_v - teacher_v)

with ``w`` by ``--opd-reward-weight-mode``: ``student_p`` (exp of the student's logprobs),
``teacher_p`` (the teacher's) or ``none`` (all equal), normalized to sum 1 over ``S`` except with
``xor`` (raw probabilities; ``none`` then weighs each token 1). An empty ``S`` gives 0. The trainer
subtracts ``--opd-kl-coef`` x this term from each token's advantage in place of the sampled token's
``student - teacher`` (:mod:`miles_disagg.trainer.opd`). Answers are SGLang's: per input position a
list of ``[logprob, token_id, text]``, the first position a placeholder, the response's positions the
last ``len(response)`` (miles' ``values[1:][-response_length:]``).

Several teachers (``--opd-teacher-urls NAME=URL ...``): a sample is scored by the teacher its
``metadata[--opd-teacher-key]`` names, the name ``default`` taking a sample whose name is missing or
unknown; without a ``default`` such a sample fails (distilling from the wrong teacher is worse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

STRATEGIES = ("only-student", "only-teacher", "intersection", "union", "xor")
WEIGHT_MODES = ("student_p", "teacher_p", "none")
STUDENT_TOP = frozenset(STRATEGIES) - {"only-teacher"}
TEACHER_TOP = frozenset(STRATEGIES) - {"only-student"}
TEACHER_ON_STUDENT = frozenset({"only-student", "union", "xor"})
STUDENT_ON_TEACHER = frozenset({"only-teacher", "union", "xor"})
DEFAULT_TEACHER = "default"
STUDENT_TOP_KEY = "opd_student_top_logprobs"  # miles' metadata key
SCORING_SAMPLING = {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False}

LogprobMap = dict[int, float]


class TopKError(ValueError):
    """An answer or a sample that top-k OPD cannot use (a missing field, a missing logprob, a length)."""


@dataclass(frozen=True)
class TopKSettings:
    """miles' ``--opd-log-prob-top-k``, ``--opd-top-k-strategy``, ``--opd-reward-weight-mode``,
    ``--opd-topk-per-position``."""

    k: int
    strategy: str = "only-student"
    weight_mode: str = "student_p"
    per_position: bool = False

    def __post_init__(self) -> None:
        if self.k < 1 or self.strategy not in STRATEGIES or self.weight_mode not in WEIGHT_MODES:
            raise ValueError(f"top-k OPD needs k >= 1, a strategy of {STRATEGIES} and a weight mode of "
                             f"{WEIGHT_MODES}; got {self.k}, {self.strategy!r}, {self.weight_mode!r}")

    @property
    def student_top(self) -> bool:
        """The student's generation calls ask for their top-K (``top_logprobs_num``)."""
        return self.strategy in STUDENT_TOP

    @property
    def teacher_top(self) -> bool:
        return self.strategy in TEACHER_TOP

    @property
    def teacher_on_student(self) -> bool:
        return self.strategy in TEACHER_ON_STUDENT

    @property
    def student_on_teacher(self) -> bool:
        return self.strategy in STUDENT_ON_TEACHER


def student_top_k(settings: TopKSettings | None) -> int:
    """The ``top_logprobs_num`` a student generation call asks for (0: none)."""
    return settings.k if settings is not None and settings.student_top else 0


# --------------------------------------------------------------------------- teachers by name


def teacher_name(metadata: Mapping[str, Any] | None, key: str, known: Iterable[str]) -> str:
    """The teacher of a sample whose metadata is ``metadata`` (miles' rule, see the module)."""
    known = set(known)
    name = (metadata or {}).get(key)
    if name is not None and str(name) in known:
        return str(name)
    if DEFAULT_TEACHER in known:
        return DEFAULT_TEACHER
    if name is None:
        raise TopKError(f"a sample's metadata has no {key!r} (--opd-teacher-key) and --opd-teacher-urls has no "
                        f"{DEFAULT_TEACHER!r} teacher")
    raise TopKError(f"a sample's metadata[{key!r}] = {name!r} names none of the --opd-teacher-urls teachers "
                    f"{sorted(known)} and there is no {DEFAULT_TEACHER!r} one")


# --------------------------------------------------------------------------- requests


def score_body(tokens: list[int], top_k: int = 0, token_ids: list[int] | None = None,
               positions: list[list[int]] | None = None) -> dict[str, Any]:
    """A scoring call (every input token, nothing generated) in SGLang's fields: also each
    position's ``top_k`` most likely tokens, and the given ids at every position (``token_ids``) or
    each position's own ids (``positions``, one list per input token)."""
    body: dict[str, Any] = {"input_ids": list(tokens), "sampling_params": dict(SCORING_SAMPLING),
                            "return_logprob": True, "logprob_start_len": 0}
    if top_k > 0:
        body["top_logprobs_num"] = top_k
    if positions is not None:
        body["token_ids_logprob_positions"] = positions
    elif token_ids:
        body["token_ids_logprob"] = token_ids
    return body


def ids_body(tokens: list[int], rows: list[list], response_length: int, settings: TopKSettings,
             top_k: int = 0) -> dict[str, Any]:
    """The scoring call that also scores ``rows``' token ids (one list of entries per response
    position): the union at every position, or each position's own with ``--opd-topk-per-position``."""
    if settings.per_position:
        return score_body(tokens, top_k, positions=per_position_ids(rows, len(tokens) - response_length))
    return score_body(tokens, top_k, token_ids=unique_ids(rows))


def entry_id(entry: Any) -> int:
    return int(entry[1])


def unique_ids(rows: Iterable[Iterable[Any] | None]) -> list[int]:
    """Every token id of ``rows``, sorted."""
    return sorted({entry_id(e) for row in rows for e in (row or []) if e is not None})


def per_position_ids(rows: list[list], prompt_len: int) -> list[list[int]]:
    """One id list per input position: none for the prompt's, each response position its row's ids."""
    return [[] for _ in range(prompt_len)] + [[entry_id(e) for e in (row or []) if e is not None] for row in rows]


# --------------------------------------------------------------------------- answers


def to_map(entries: Iterable[Any] | None) -> LogprobMap:
    """``[[logprob, token_id, text], ...]`` as ``{token_id: logprob}`` (None: empty)."""
    out: LogprobMap = {}
    for entry in entries or []:
        if entry is None:
            continue
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise TopKError(f"a top-k entry {entry!r} is not [logprob, token_id, text]")
        value = entry[0]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise TopKError(f"the logprob of token {entry[1]!r} is {value!r}, not a finite number")
        out[entry_id(entry)] = float(value)
    return out


def response_rows(meta: Mapping[str, Any], name: str, response_length: int, who: str = "the answer") -> list:
    """The response positions' entries of the input field ``name`` of a scoring answer's ``meta_info``
    (``who``: whose answer, for the error)."""
    values = meta.get(name) if isinstance(meta, Mapping) else None
    if not isinstance(values, list):
        raise TopKError(f"{who} has no meta_info.{name} (SGLang's answer to top_logprobs_num / token_ids_logprob "
                        "with return_logprob and logprob_start_len 0)")
    rows = values[1:][-response_length:] if response_length > 0 else []
    if len(rows) != response_length:
        raise TopKError(f"{who}'s meta_info.{name} holds {len(values)} positions, fewer than the {response_length} "
                        "response tokens it must score")
    return rows


def student_rows(metadata: Mapping[str, Any] | None, response_length: int) -> list:
    """The student's top-K of each response position from its generation calls."""
    rows = (metadata or {}).get(STUDENT_TOP_KEY)
    if not isinstance(rows, list):
        raise TopKError(f"the sample has no metadata[{STUDENT_TOP_KEY!r}]: top-k OPD with a student-side strategy "
                        "needs the student's top_logprobs_num answer of its generation calls (a custom generate "
                        "function must generate through args.engine, or keep them itself)")
    rows = rows[-response_length:] if response_length > 0 else []
    if len(rows) != response_length:
        raise TopKError(f"the student's top-k logprobs cover {len(rows)} positions, the response {response_length}")
    return rows


def keep_student_top(metadata: dict[str, Any], meta_info: Mapping[str, Any], num_tokens: int) -> None:
    """Append a student generation call's ``output_top_logprobs`` (one row per output token) to
    ``metadata[STUDENT_TOP_KEY]``; ``TopKError`` unless the engine answered one row per token."""
    rows = meta_info.get("output_top_logprobs") if isinstance(meta_info, Mapping) else None
    if not isinstance(rows, list) or len(rows) != num_tokens:
        got = len(rows) if isinstance(rows, list) else "no"
        raise TopKError(f"the student's engine answered {got} output_top_logprobs rows for {num_tokens} tokens "
                        "(top-k OPD asks every generation call for top_logprobs_num)")
    metadata.setdefault(STUDENT_TOP_KEY, []).extend(rows)


def pad_student_top(metadata: dict[str, Any], num_tokens: int) -> None:
    """Tokens no student call generated (tool output) get empty rows, so rows stay one per response token."""
    if STUDENT_TOP_KEY in metadata:
        metadata[STUDENT_TOP_KEY].extend([] for _ in range(num_tokens))


# --------------------------------------------------------------------------- the term


def selected_ids(strategy: str, student_ids: list[int], teacher_ids: list[int]) -> list[int]:
    """The position's token set ``S`` by ``strategy`` (each id once)."""
    students, teachers = set(student_ids), set(teacher_ids)
    if strategy == "only-student":
        return list(student_ids)
    if strategy == "only-teacher":
        return list(teacher_ids)
    if strategy == "intersection":
        return [t for t in student_ids if t in teachers]
    if strategy == "union":
        return list(dict.fromkeys([*student_ids, *teacher_ids]))
    if strategy == "xor":
        return [t for t in [*student_ids, *teacher_ids] if (t in students) != (t in teachers)]
    raise ValueError(f"unknown top-k strategy {strategy!r}")


def weights(student: list[float], teacher: list[float], mode: str, normalize: bool) -> list[float]:
    """Each token's weight (see the module): probabilities by ``mode``, normalized over the set if asked."""
    if not student:
        return []
    logps = {"student_p": student, "teacher_p": teacher, "none": [0.0] * len(student)}.get(mode)
    if logps is None:
        raise ValueError(f"unknown reward weight mode {mode!r}")
    if not normalize:
        return [math.exp(v) for v in logps]
    top = max(logps)
    exps = [math.exp(v - top) for v in logps]
    total = sum(exps)
    return [e / total for e in exps]


def _lookup(token: int, primary: LogprobMap, fallback: LogprobMap, side: str, position: int) -> float:
    if token in primary:
        return primary[token]
    if token in fallback:
        return fallback[token]
    raise TopKError(f"no {side} logprob of token {token} at response position {position}")


def position_kl(settings: TopKSettings, position: int, student_top: LogprobMap, teacher_top: LogprobMap,
                teacher_on_student: LogprobMap, student_on_teacher: LogprobMap) -> float:
    """One position's weighted reverse KL over its token set."""
    ids = selected_ids(settings.strategy, list(student_top), list(teacher_top))
    student = [_lookup(t, student_top, student_on_teacher, "student", position) for t in ids]
    teacher = [_lookup(t, teacher_top, teacher_on_student, "teacher", position) for t in ids]
    w = weights(student, teacher, settings.weight_mode, normalize=settings.strategy != "xor")
    return sum(wi * (s - t) for wi, s, t in zip(w, student, teacher, strict=True))


def reverse_kl(settings: TopKSettings, response_length: int, student_top: list | None,
               teacher_meta: Mapping[str, Any], student_meta: Mapping[str, Any] | None) -> list[float]:
    """Every response position's term from the student's top-K rows (``student_top``), the teacher's
    scoring answer's ``meta_info`` and the student's scoring answer's (``student_meta``, for the
    strategies where the student scores the teacher's ids)."""
    empty: list[LogprobMap] = [{} for _ in range(response_length)]

    def maps(wanted: bool, meta, name: str, who: str) -> list[LogprobMap]:
        return [to_map(row) for row in response_rows(meta, name, response_length, who)] if wanted else empty

    students = [to_map(row) for row in student_top] if settings.student_top else empty
    teachers = maps(settings.teacher_top, teacher_meta, "input_top_logprobs", "the teacher's answer")
    teacher_on = maps(settings.teacher_on_student, teacher_meta, "input_token_ids_logprobs", "the teacher's answer")
    student_on = maps(settings.student_on_teacher, student_meta or {}, "input_token_ids_logprobs",
                      "the student's scoring answer")
    return [position_kl(settings, i, students[i], teachers[i], teacher_on[i], student_on[i])
            for i in range(response_length)]
