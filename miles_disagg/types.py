"""Pure domain types and rules: policy versions, version constraints, samples, errors.

No I/O and no heavy imports (no torch, ray, numpy, HTTP) so this module imports anywhere.

Errors are typed by what the caller must do:

* ``Retryable``       - try again later (``VersionNotReady``, ``PublishConflict``).
* ``ReplaceReplica``  - the engine/replica is unusable; take it out of rotation.
* ``FailRun``         - the run cannot continue safely (``LineageError``,
  ``ChecksumMismatch``, ``LayoutMismatch``, ``FormatError``, ``ConfigError``).
* ``InvalidInput``    - the request or argument is wrong; nothing was changed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

VERSION_DIR_PREFIX = "weight_v"
BASE_VERSION = 0


# --------------------------------------------------------------------------- errors


class MilesDisaggError(Exception):
    """Root of every error this project raises on purpose.

    Every subclass survives pickling with all its fields (Ray and process boundaries), even
    when its constructor takes other arguments than the message.
    """

    def __reduce__(self):
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


def _rebuild_error(cls: type, args: tuple, state: dict) -> "MilesDisaggError":
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class Retryable(MilesDisaggError):
    """The operation may succeed if tried again later; nothing was changed."""


class ReplaceReplica(MilesDisaggError):
    """The replica/engine is unusable; take it out of rotation and replace it."""


class FailRun(MilesDisaggError):
    """Continuing would risk a wrong policy; stop and surface to the operator."""


class InvalidInput(MilesDisaggError):
    """The caller passed something malformed; nothing was changed."""


class Forbidden(InvalidInput):
    """The request names something this server may not touch (a path outside its roots, a
    version label no verified load backs); nothing was changed. HTTP 403."""


class ConfigError(FailRun, InvalidInput):
    """The configuration is invalid; raised before anything starts."""

    def __init__(self, message: str, flags: tuple[str, ...] = ()):
        self.flags = tuple(flags)
        super().__init__(message)


class VersionNotReady(Retryable):
    """No replica/host can serve a request's version constraint yet."""

    def __init__(self, constraint: "VersionConstraint", available: list[int] | None = None):
        self.constraint = constraint
        self.available = list(available or [])
        super().__init__(
            f"no ready worker satisfies {constraint.describe()}; available versions: {self.available}"
        )


class PublishConflict(Retryable):
    """Another publisher moved the pointer first (expected, actual, proposed)."""

    def __init__(self, expected: "VersionRef | None", actual: "VersionRef | None", proposed: "VersionRef"):
        self.expected, self.actual, self.proposed = expected, actual, proposed
        super().__init__(
            f"publish of {proposed} lost a race: expected the store at {expected}, found {actual}"
        )


class EngineUnrecoverable(ReplaceReplica):
    """An engine failed after activation started or stopped answering."""


class EngineUnreachable(EngineUnrecoverable, Retryable):
    """An engine did not answer (down, restarting or hung): take it out of rotation until it
    answers again; a request it did not take may be retried elsewhere."""


class LineageError(FailRun):
    """A delta does not apply onto the version the host holds (expected vs actual)."""

    def __init__(self, message: str, expected: "VersionRef | None" = None, actual: "VersionRef | None" = None):
        self.expected, self.actual = expected, actual
        super().__init__(message)


class ChecksumMismatch(FailRun):
    """A tensor's final bytes do not hash to the published checksum."""

    def __init__(self, tensor: str, expected: str, actual: str, algorithm: str):
        self.tensor, self.expected, self.actual, self.algorithm = tensor, expected, actual, algorithm
        super().__init__(
            f"checksum mismatch for tensor {tensor!r} ({algorithm}): expected {expected}, got {actual}"
        )


class LayoutMismatch(FailRun):
    """A tensor's dtype/shape/size differs between the version and the local checkpoint."""


class FormatError(FailRun, InvalidInput):
    """A version directory or payload is malformed, truncated or of an unknown format."""


class StoreUnavailable(Retryable):
    """An object store did not answer (unreachable, throttling, resets) within the retry bound;
    the message names the object. Nothing was changed: the held version stays held."""


class StoreAccessDenied(FailRun, InvalidInput):
    """An object store refused the credentials or the permission (403, unknown key, bad signature)."""


class NodeLost(FailRun):
    """A Ray node the run had placed work on left the cluster (its machine or raylet died)."""

    def __init__(self, message: str, node_id: str = "", node_ip: str = ""):
        self.node_id, self.node_ip = node_id, node_ip
        super().__init__(message)


class TrainerLost(FailRun):
    """A trainer rank died (its process was killed, or its node left the cluster) during a call
    of the trainer group. With ``--max-trainer-restarts N`` the run restarts the trainer group
    from its last save (``loop/trainer_restart.py``); without, the run ends with this one line."""

    def __init__(self, message: str, rank: int = -1, node_id: str = ""):
        self.rank, self.node_id = rank, node_id
        super().__init__(message)


class RolloutCapacityLost(FailRun):
    """Fewer than ``--min-rollout-engines`` engines served for longer than its timeout (nodes
    were lost and nothing replaced them in time)."""


# --------------------------------------------------------------------------- versions


@dataclass(frozen=True, order=True)
class VersionRef:
    """Identity of one policy version: ``(run_id, version)``; version 0 is the base checkpoint."""

    run_id: str
    version: int

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0:
            raise ValueError(f"version must be a non-negative int, got {self.version!r}")
        if not isinstance(self.run_id, str):
            raise ValueError(f"run_id must be a string, got {self.run_id!r}")

    @property
    def dirname(self) -> str:
        return version_dirname(self.version)

    def __str__(self) -> str:
        return f"{self.run_id or '<no run>'}@v{self.version}"


def version_dirname(version: int) -> str:
    """``weight_vNNNNNN`` for a version number (six digits, zero padded)."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return f"{VERSION_DIR_PREFIX}{version:06d}"


def parse_version_dirname(name: str) -> int | None:
    """Inverse of :func:`version_dirname`; ``None`` for names that are not version directories."""
    if not name.startswith(VERSION_DIR_PREFIX):
        return None
    digits = name[len(VERSION_DIR_PREFIX):]
    if not digits.isdigit() or len(digits) < 6:
        return None
    return int(digits)


def same_run(a: str, b: str) -> bool:
    """Runs match when equal; an empty run id (a foreign producer's version) matches any run."""
    return not a or not b or a == b


def applies_onto(delta_base: VersionRef, held: VersionRef) -> bool:
    """A delta applies only onto exactly its base version of the same run.

    XOR deltas applied onto the wrong base (or twice) silently corrupt weights, so this is
    a hard rule, not a heuristic: the store's chain planning (``VersionStore.plan_chain``)
    starts from the held version only when the next delta applies onto it.
    """
    return same_run(delta_base.run_id, held.run_id) and delta_base.version == held.version


def check_pointer_advance(current: VersionRef | None, proposed: VersionRef) -> None:
    """The store pointer only moves forward by exactly one within a run."""
    if current is None:
        if proposed.version != 1:
            raise PublishConflict(None, None, proposed)
        return
    if current.run_id != proposed.run_id or proposed.version != current.version + 1:
        raise PublishConflict(current, current, proposed)


@dataclass(frozen=True)
class VersionConstraint:
    """What a rollout request accepts: at least ``min_version``, or exactly ``exact_version``,
    and, when ``run_id`` is given, only versions of that run (a store wiped and reused by a new
    run restarts its numbering: another run's "version 3" is another policy)."""

    min_version: int | None = None
    exact_version: int | None = None
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.min_version is not None and self.exact_version is not None:
            raise ValueError("give min_version or exact_version, not both")
        for value in (self.min_version, self.exact_version):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"version constraint must be a non-negative int, got {value!r}")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not self.run_id):
            raise ValueError(f"run_id must be a non-empty string, got {self.run_id!r}")

    def allows(self, version: int, run_id: str | None = None) -> bool:
        """Whether ``version`` of run ``run_id`` (None: unknown) satisfies this constraint."""
        if self.run_id is not None and run_id != self.run_id and version != BASE_VERSION:
            return False  # the base (version 0) is every run's start, whoever reports it
        return self.allows_version(version)

    def allows_version(self, version: int) -> bool:
        """The version bound alone (the run is checked by whoever knows the server's run)."""
        if self.exact_version is not None:
            return version == self.exact_version
        if self.min_version is not None:
            return version >= self.min_version
        return True

    def describe(self) -> str:
        if self.exact_version is not None:
            text = f"exact_version={self.exact_version}"
        elif self.min_version is not None:
            text = f"min_version={self.min_version}"
        else:
            text = "any version"
        return text if self.run_id is None else f"{text} of run {self.run_id!r}"

    @classmethod
    def from_json(cls, obj: Any) -> "VersionConstraint":
        """Parse ``{"min_version": N}`` / ``{"exact_version": N}`` (optionally with ``"run_id"``);
        ``InvalidInput`` otherwise."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict) or set(obj) - {"min_version", "exact_version", "run_id"}:
            raise InvalidInput(f"weight_version must be {{'min_version': N}} or {{'exact_version': N}} (optionally "
                               f"with 'run_id'), got {obj!r}")
        try:
            return cls(min_version=obj.get("min_version"), exact_version=obj.get("exact_version"),
                       run_id=obj.get("run_id"))
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc


# --------------------------------------------------------------------------- samples


class SampleStatus(str, Enum):
    """miles' ``Sample.Status`` values; a member equals its string (``SampleStatus.COMPLETED == "completed"``)."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One trajectory and the policy versions that generated it (from the response).

    Field names are this project's; miles' names are aliases (``tokens``, ``response_length``,
    ``rollout_log_probs`` settable, ``weight_versions`` read-only) so hooks written against
    miles' ``Sample`` read and fill the same values; like miles', a sample takes free attributes.
    A multi-turn episode appends to ``response_ids`` turn by turn: tokens the policy generated
    (``loss_mask`` 1, their engine logprob) and tokens the environment inserted (``loss_mask`` 0,
    logprob 0.0 as a placeholder).
    """

    Status = SampleStatus  # miles spells statuses Sample.Status.COMPLETED

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    reward: float | None = 0.0
    """None only while a sample is being generated (a generate function may set it; else the reward function does)."""
    weight_version_start: int = BASE_VERSION
    weight_version_end: int = BASE_VERSION
    finish_reason: str = "length"
    metadata: dict[str, Any] = field(default_factory=dict)
    advantage: float = 0.0  # set by the trainer's advantage estimator
    loss_mask: list[int] | None = None
    """One 0/1 per response token: 0 for tokens the policy did not generate (tool or environment
    output in a multi-turn episode), which get no gradient. None: every response token is trained."""
    status: str = "completed"
    """``completed``, ``truncated`` or ``aborted`` (miles' sample status)."""
    prompt: str = ""
    """The rendered prompt text (miles' ``prompt``)."""
    label: Any = None
    """The dataset label (miles' ``label``)."""
    response: str = ""
    """The response text: every turn, environment text included (miles' ``response``)."""
    call_versions: list[list[int]] = field(default_factory=list)
    """``[start, end]`` served versions of each engine call that generated part of this sample, in
    order; ``weight_version_start`` is the first call's start, ``weight_version_end`` the last call's end."""
    rollout_routed_experts: Any = None
    """MoE routing replay (miles' field name): the experts the engines routed each token to, a numpy
    int32 array ``[len(prompt_ids) + len(response_ids) - 1, num_hidden_layers, num_experts_per_tok]``;
    row ``p`` is the routing of the token at position ``p`` of prompt + response (the last token never
    ran through the model, as in SGLang's ``meta_info["routed_experts"]``); layers without experts
    (dense MLP) hold -1. In a multi-turn sample row ``p`` comes from the engine call that first ran
    position ``p`` through the model, so each token replays the routing of the version that served it.
    None unless ``--use-rollout-routing-replay``."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation (``--use-opd``): the teacher's logprob of each response token given the
    prompt and the response before it (miles' ``teacher_log_probs``); None: not scored by a teacher."""
    teacher_version: str | None = None
    """The ``weight_version`` the teacher reported for the call that scored ``teacher_logprobs``."""
    opd_reverse_kl: list[float] | None = None
    """Top-k on-policy distillation (``--opd-log-prob-top-k``): each response token's reverse KL over its
    top-k token set, computed at rollout (miles' ``opd_reverse_kl``); the trainer takes it in place of
    ``student - teacher_logprobs``. None: sampled-token OPD (or none)."""

    def trained_mask(self) -> list[int]:
        """The loss mask, all ones when none was given."""
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.response_ids)

    @property
    def mixed_version(self) -> bool:
        return self.weight_version_start != self.weight_version_end

    # miles' names (miles' hooks set tokens, response_length and rollout_log_probs)
    @property
    def tokens(self) -> list[int]:
        """Prompt and response token ids (miles' ``tokens``)."""
        return list(self.prompt_ids) + list(self.response_ids)

    @tokens.setter
    def tokens(self, value: list[int]) -> None:
        """miles' hooks set ``tokens`` (prompt + response) and then ``response_length``: the split
        stays at the current prompt length until ``response_length`` moves it."""
        value = list(value)
        cut = min(len(self.prompt_ids), len(value))
        self.prompt_ids, self.response_ids = value[:cut], value[cut:]

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @response_length.setter
    def response_length(self, value: int) -> None:
        """The last ``value`` of ``tokens`` are the response (miles' meaning)."""
        tokens = self.tokens
        if not isinstance(value, int) or not 0 <= value <= len(tokens):
            raise InvalidInput(f"response_length {value!r} must be an int in [0, {len(tokens)}] (len(tokens))")
        self.prompt_ids, self.response_ids = tokens[:len(tokens) - value], tokens[len(tokens) - value:]

    @property
    def rollout_log_probs(self) -> list[float]:
        return self.response_logprobs

    @rollout_log_probs.setter
    def rollout_log_probs(self, value: list[float] | None) -> None:
        self.response_logprobs = [] if value is None else [float(x) for x in value]

    @property
    def teacher_log_probs(self) -> list[float] | None:
        """miles' name of ``teacher_logprobs`` (a miles hook may set a tensor or a list)."""
        return self.teacher_logprobs

    @teacher_log_probs.setter
    def teacher_log_probs(self, value) -> None:
        self.teacher_logprobs = None if value is None else [float(x) for x in value]

    @property
    def weight_versions(self) -> list[str]:
        """The version that finished each engine call, as strings (miles' ``weight_versions``)."""
        calls = self.call_versions or [[self.weight_version_start, self.weight_version_end]]
        return [str(end) for _, end in calls]

    @property
    def effective_response_length(self) -> int:
        """Response tokens that are trained (``loss_mask`` 1)."""
        return sum(self.trained_mask())

    # building a sample turn by turn
    def append_response(self, token_ids: list[int], logprobs: list[float] | None = None, *, trained: bool) -> None:
        """Append ``token_ids`` to the response: ``trained=True`` for tokens the policy generated (their
        engine logprobs, one per token), ``trained=False`` for environment or tool tokens (no gradient;
        logprob 0.0 placeholders). The loss mask stays one entry per response token."""
        token_ids = list(token_ids)
        logprobs = [0.0] * len(token_ids) if logprobs is None else [float(x) for x in logprobs]
        if len(logprobs) != len(token_ids):
            raise InvalidInput(f"{len(token_ids)} tokens but {len(logprobs)} logprobs")
        if not trained and self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)
        if self.loss_mask is not None:
            self.loss_mask.extend([1 if trained else 0] * len(token_ids))
        self.response_ids.extend(token_ids)
        self.response_logprobs.extend(logprobs)

    def record_engine_call(self, start: int, end: int) -> None:
        """One engine call served by versions ``start``..``end``: the sample's start is its first call's."""
        if not self.call_versions:
            self.weight_version_start = start
        self.call_versions.append([start, end])
        self.weight_version_end = end

    def check_consistent(self) -> None:
        """``InvalidInput`` unless the per-token fields line up (one logprob, one mask entry and any
        teacher logprob per response token) and the start/end versions are the first and last calls' versions."""
        n = len(self.response_ids)
        if len(self.response_logprobs) != n:
            raise InvalidInput(f"{n} response tokens but {len(self.response_logprobs)} rollout logprobs")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise InvalidInput(f"{n} response tokens but {len(self.teacher_logprobs)} teacher logprobs")
        if self.opd_reverse_kl is not None and len(self.opd_reverse_kl) != n:
            raise InvalidInput(f"{n} response tokens but {len(self.opd_reverse_kl)} opd_reverse_kl terms")
        if self.loss_mask is not None and (len(self.loss_mask) != n or set(self.loss_mask) - {0, 1}):
            raise InvalidInput(f"loss_mask must hold one 0/1 per response token ({n}), got {self.loss_mask!r}")
        if self.call_versions and [self.weight_version_start, self.weight_version_end] != \
                [self.call_versions[0][0], self.call_versions[-1][1]]:
            raise InvalidInput(f"start/end versions {self.weight_version_start}/{self.weight_version_end} are not "
                               f"those of the first and last engine calls {self.call_versions}")


@dataclass
class Group:
    """The ``n_samples_per_prompt`` samples of one prompt (the unit GRPO normalizes over)."""

    prompt_index: int
    samples: list[Sample]

    @property
    def oldest_version(self) -> int:
        return min(s.weight_version_start for s in self.samples)

    def staleness(self, current_version: int) -> int:
        return current_version - self.oldest_version


@dataclass
class RolloutBatch:
    """Groups handed to the trainer, with the rollout's metrics for them (staleness, rewards, counters)."""

    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)
    advantages_given: bool = False
    """True when the rollout already set every sample's ``advantage`` (``--custom-reward-post-process-path``):
    the trainer's advantage estimator must not overwrite them."""

    @property
    def num_samples(self) -> int:
        return sum(len(g.samples) for g in self.groups)


def asdict(obj: Any) -> dict[str, Any]:
    """Dataclass to plain dict (re-exported so callers need not import dataclasses)."""
    return dataclasses.asdict(obj)
