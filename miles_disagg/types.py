"""Pure domain types and rules: policy versions, version constraints, errors (samples: ``samples.py``).

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
from dataclasses import dataclass
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


def asdict(obj: Any) -> dict[str, Any]:
    """Dataclass to plain dict (re-exported so callers need not import dataclasses)."""
    return dataclasses.asdict(obj)
