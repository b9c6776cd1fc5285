"""Rules over the on-policy distillation flags (miles' ``--use-opd`` group), miles' own first.

A teacher here is an engine answering SGLang's ``/generate`` (``--opd-type sglang``): one the user
started (``--rm-url``, miles' flag), several by name (``--opd-teacher-urls NAME=URL ...``, miles'
flag), or one the job serves (``--opd-teacher-hf-checkpoint``). Top-k OPD's flags
(``--opd-log-prob-top-k`` and its strategy, weight mode and per-position switch) take effect only
with ``--use-opd`` and are accepted without it, as miles does. Each failure is one ``ConfigError``
line naming the flags, what is wrong and what to give instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable
from urllib.parse import urlsplit

from miles_disagg.config.miles_flags import miles_refusal
from miles_disagg.types import ConfigError

TEACHER_FLAGS = ("--rm-url", "--opd-teacher-urls", "--opd-teacher-hf-checkpoint")


def parse_teacher_urls(values: Iterable[str]) -> dict[str, str]:
    """``NAME=URL`` entries (split at the first ``=``) as a map; ``ValueError`` naming a malformed
    entry or a repeated name."""
    routes: dict[str, str] = {}
    for entry in values:
        name, sep, url = (part.strip() for part in str(entry).partition("="))
        if not sep or not name or not url:
            raise ValueError(f"--opd-teacher-urls entry {entry!r}: expected NAME=URL")
        if name in routes:
            raise ValueError(f"--opd-teacher-urls names the teacher {name!r} twice")
        routes[name] = url
    return routes


def check_opd_rules(config) -> None:
    """``ConfigError`` for the first invalid combination of a ``RunConfig``'s OPD flags."""
    train, rollout = config.train, config.rollout
    if not train.use_opd:
        if train.opd_teacher_load is not None:
            raise ConfigError("--opd-teacher-load is the teacher of on-policy distillation and is set without "
                              "--use-opd (miles refuses it too): add --use-opd, or drop it",
                              ("--opd-teacher-load", "--use-opd"))
        if rollout.opd_teacher_urls:
            raise ConfigError("--opd-teacher-urls names the teachers of on-policy distillation and is set without "
                              "--use-opd (miles refuses it too): add --use-opd, or drop it",
                              ("--opd-teacher-urls", "--use-opd"))
        if rollout.opd_teacher_hf_checkpoint:
            raise ConfigError("--opd-teacher-hf-checkpoint serves the teacher of on-policy distillation: add --use-opd "
                              "--opd-type sglang, or drop it", ("--opd-teacher-hf-checkpoint", "--use-opd"))
        return
    if rollout.opd_log_prob_top_k < 0:
        raise ConfigError(f"--opd-log-prob-top-k {rollout.opd_log_prob_top_k}: must be non-negative (miles' rule; "
                          "0: sampled-token OPD)", ("--opd-log-prob-top-k",))
    _check_type(train)
    _check_student_logprobs(train)
    if rollout.debug_train_only:  # the saved samples carry their teacher logprobs; no teacher is asked
        return
    _check_teacher(config)


def _check_type(train) -> None:
    if train.opd_type is None:
        raise ConfigError("--opd-type must be given with --use-opd (miles' rule): --opd-type sglang (a teacher engine)",
                          ("--use-opd", "--opd-type"))
    if train.opd_type == "megatron":
        raise ConfigError(miles_refusal(
            "--opd-type megatron", "it loads the teacher into the trainer's Megatron process and runs it in the "
            "training step, and the trainer here holds only the policy (and the reference)",
            "serve the teacher as an engine: --opd-type sglang with --rm-url http://HOST:PORT/generate, or "
            "--opd-teacher-hf-checkpoint DIR"), ("--opd-type",))
    for name, value in (("--opd-teacher-load", train.opd_teacher_load),
                        ("--opd-teacher-ckpt-step", train.opd_teacher_ckpt_step)):
        if value is not None:
            raise ConfigError(f"{name} is the Megatron teacher of --opd-type megatron and must not be set with "
                              "--opd-type sglang (miles' rule): drop it", (name, "--opd-type"))


def _check_student_logprobs(train) -> None:
    """The OPD term is computed from the student's logprobs of the sampled tokens and lives in the
    advantages: both must exist before training (miles would silently skip it otherwise;
    ``--skip-actor-forward-only`` with ``--use-opd`` is refused by ``loss_rules``)."""
    if train.disable_compute_advantages_and_returns:
        raise ConfigError("--use-opd subtracts its reverse KL from the advantages, and "
                          "--disable-compute-advantages-and-returns computes none: drop one of them",
                          ("--use-opd", "--disable-compute-advantages-and-returns"))


def _check_teacher(config) -> None:
    rollout = config.rollout
    values = (rollout.rm_url, rollout.opd_teacher_urls, rollout.opd_teacher_hf_checkpoint)
    given = [name for name, value in zip(TEACHER_FLAGS, values) if value]
    if not given:
        raise ConfigError("--use-opd --opd-type sglang needs its teacher: --rm-url http://HOST:PORT/generate (an engine "
                          "you started), --opd-teacher-urls NAME=URL ... (several, by sample metadata) or "
                          "--opd-teacher-hf-checkpoint DIR (one the job serves)", ("--use-opd", *TEACHER_FLAGS))
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} each name the teacher; give one (with --opd-teacher-urls, name the "
                          "fallback teacher default=URL)", tuple(given))
    if rollout.rm_url:
        _check_teacher_url(rollout.rm_url, "--rm-url")
    elif rollout.opd_teacher_urls:
        _check_teacher_urls(rollout.opd_teacher_urls)
    else:
        _check_teacher_checkpoint(rollout.opd_teacher_hf_checkpoint, config.train)


def _check_teacher_url(url: str, flag: str, given: str | None = None) -> None:
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment or \
            (path and not path.endswith("/generate")):
        raise ConfigError(f"{flag} {given or url!r}: expected the teacher's http://HOST:PORT/generate", (flag,))


def _check_teacher_urls(entries: list[str]) -> None:
    """miles' parse (``NAME=URL``, no name twice), then each URL as ``--rm-url``'s."""
    try:
        routes = parse_teacher_urls(entries)
    except ValueError as exc:
        raise ConfigError(f"{exc} (miles' rule)", ("--opd-teacher-urls",)) from None
    for name, url in routes.items():
        _check_teacher_url(url, "--opd-teacher-urls", f"{name}={url}")


def _check_teacher_checkpoint(teacher: str, train) -> None:
    """The job's teacher must be a checkpoint with the student's vocabulary (it scores the student's ids);
    the student's own base (``--hf-checkpoint``, maybe made on the spot by ``--hf-checkpoint-init``) is one."""
    flag, student = "--opd-teacher-hf-checkpoint", train.hf_checkpoint
    if student and Path(teacher).resolve() == Path(student).resolve():
        return
    path = Path(teacher) / "config.json"
    try:
        vocab = json.loads(path.read_text()).get("vocab_size")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{flag} {teacher!r} is not a readable HF checkpoint ({path}: {exc})", (flag,)) from None
    student_config = Path(student or "") / "config.json"
    if not student or not student_config.is_file():
        return  # the student is made on the spot (--hf-checkpoint-init): the teacher's answers are checked then
    student_vocab = json.loads(student_config.read_text()).get("vocab_size")
    if vocab != student_vocab:
        raise ConfigError(f"{flag} {teacher!r} has vocab_size {vocab}, the student {student_vocab}: the teacher scores "
                          "the student's token ids, so it needs the same vocabulary", (flag, "--hf-checkpoint"))
