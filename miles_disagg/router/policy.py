"""Routing policy: which worker serves a request. Pure, no I/O.

Only ``ready`` workers whose version satisfies the request's constraint are eligible; a
worker of unknown version serves only unconstrained requests. Among eligible workers the
one with the fewest outstanding requests wins; ties rotate round robin. There is no
fallback to an older policy: when nothing satisfies the constraint the caller gets
``VersionNotReady`` (retry later), never a worker of another version.

A request states its constraint in the body (``"weight_version": {"min_version": N}`` or
``{"exact_version": N}``, either optionally with ``"run_id"``: then only workers known to serve
that run's versions qualify, which only the rollout service's gateway knows) or in the ``X-Weight-Version-Min`` / ``X-Weight-Version-Exact``
headers; :func:`request_constraint` reads (and strips) it.

A worker's versions are the newest it serves (``weight_version``) and the older LoRA adapter versions it
keeps resident (:attr:`~miles_disagg.router.registry.Worker.older_versions`): an ``exact_version``
request may go to a worker holding that version among its older ones, and is then sent with that
version's ``lora_path`` (:func:`pinned_body`); ``min_version`` is judged against the newest alone (the
one a request naming no adapter runs on), and so is everything for a worker of one version.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import AbstractSet, Any, Mapping, Sequence

from miles_disagg.router.registry import Worker, WorkerRegistry, WorkerState, parse_version
from miles_disagg.types import InvalidInput, Retryable, VersionConstraint, VersionNotReady

MIN_HEADER, EXACT_HEADER = "x-weight-version-min", "x-weight-version-exact"


class NoWorkerAvailable(Retryable):
    """No worker is ready at all (none registered, or all starting/paused/activating/unhealthy)."""

    def __init__(self, message: str, states: dict[str, int] | None = None):
        self.states = dict(states or {})
        super().__init__(message)


def is_unconstrained(constraint: VersionConstraint) -> bool:
    return constraint.min_version is None and constraint.exact_version is None and constraint.run_id is None


def satisfies(version: int | None, constraint: VersionConstraint, run_id: str | None = None) -> bool:
    """Whether a worker at ``version`` of run ``run_id`` may serve ``constraint`` (an unknown
    version satisfies only "any"; a constraint naming a run only a worker known to be of it)."""
    if version is None:
        return is_unconstrained(constraint)
    return constraint.allows(version, run_id)


def worker_satisfies(worker: Worker, constraint: VersionConstraint) -> bool:
    """Whether ``worker`` may serve ``constraint``: at its newest version, or (``exact_version``) on an
    older version it keeps resident."""
    exact = constraint.exact_version
    if exact is not None and exact in worker.older_versions:  # an empty mapping for most workers: O(1)
        return constraint.allows(exact, worker.run_id)
    return satisfies(worker.weight_version, constraint, worker.run_id)


def pinned_path(worker: Worker, constraint: VersionConstraint) -> str | None:
    """The ``lora_path`` an ``exact_version`` request must carry to run on ``worker``'s older resident
    version (None: it runs on the newest, as every other request)."""
    exact = constraint.exact_version
    return None if exact is None else worker.older_versions.get(exact)


def pinned_body(body: Any, worker: Worker, constraint: VersionConstraint) -> dict | None:
    """``body`` with the ``lora_path`` of the older resident version it is pinned to on ``worker``
    (:func:`pinned_path`), or None when it needs none or names its own ``lora_path`` (then the engine's
    answer shows the version it ran on, judged as any other)."""
    path = pinned_path(worker, constraint)
    if path is None or not isinstance(body, dict) or body.get("lora_path") is not None:
        return None
    return {**body, "lora_path": path}


def version_served(worker: Worker, constraint: VersionConstraint) -> int | None:
    """The version a request under ``constraint`` runs on at ``worker`` (its newest unless pinned)."""
    return constraint.exact_version if pinned_path(worker, constraint) is not None else worker.weight_version


def ready_versions(workers: Sequence[Worker]) -> list[int]:
    """Distinct known versions of the ready workers (their older resident ones too), ascending."""
    versions: set[int] = set()
    for w in workers:
        if w.state is WorkerState.READY and w.weight_version is not None:
            versions.add(w.weight_version)
            versions.update(w.older_versions)
    return sorted(versions)


class LeastOutstandingPolicy:
    """Fewest outstanding requests among eligible workers; ties go round robin."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, workers: Sequence[Worker], constraint: VersionConstraint) -> Worker:
        """The worker for one request (``workers`` in registration order).

        Raises ``NoWorkerAvailable`` when no worker is ready and ``VersionNotReady`` when
        ready workers exist but none satisfies ``constraint``.
        """
        # one pass, no intermediate lists: this runs for every request, over every worker
        tied: list[Worker] = []
        fewest = -1
        any_ready = False
        for worker in workers:
            if worker.state is not WorkerState.READY:
                continue
            any_ready = True
            if not worker_satisfies(worker, constraint):
                continue
            if fewest < 0 or worker.outstanding < fewest:
                fewest, tied = worker.outstanding, [worker]
            elif worker.outstanding == fewest:
                tied.append(worker)
        if not tied:
            self._refuse(workers, constraint, any_ready)
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        return chosen

    def choose_in(self, registry: WorkerRegistry, constraint: VersionConstraint,
                  skip: AbstractSet[Worker] = frozenset()) -> Worker:
        """:meth:`choose` over ``registry``'s load index (what the router calls for every request).

        The same rule, fewest outstanding among eligible workers with ties in turn, without a pass
        over the pool: the first eligible worker in load order wins and goes behind its equals. The
        pass is only made when workers that cannot take the request sit at the lowest loads (paused
        or draining ones, other versions), and to explain a refusal. ``skip``: workers this request
        already tried (``NoWorkerAvailable`` when only they are eligible)."""
        for worker in registry.by_load():
            if (worker.state is WorkerState.READY and worker not in skip
                    and worker_satisfies(worker, constraint)):
                break
        else:
            chosen = self.choose(registry.workers(), constraint)  # raises NoWorkerAvailable / VersionNotReady
            if chosen in skip:
                raise NoWorkerAvailable(f"every eligible worker was tried ({len(skip)}) and none could be reached")
            return chosen
        registry.to_back(worker)
        return worker

    @staticmethod
    def _refuse(workers: Sequence[Worker], constraint: VersionConstraint, any_ready: bool) -> None:
        if not any_ready:
            states = dict(Counter(w.state.value for w in workers))
            what = f"worker states: {states}" if workers else "no workers are registered"
            raise NoWorkerAvailable(f"no ready worker ({what})", states)
        raise VersionNotReady(constraint, ready_versions(workers))


# --------------------------------------------------------------------------- request constraints


def request_constraint(body: dict, headers: Mapping[str, str]) -> VersionConstraint:
    """The request's constraint; pops ``weight_version`` from ``body`` (engines do not know it).

    ``headers``: lower-case names, or a case-insensitive mapping. Both sources may be given
    only if they agree. ``InvalidInput`` for anything malformed.
    """
    from_body = VersionConstraint.from_json(body.pop("weight_version", None))
    if MIN_HEADER not in headers and EXACT_HEADER not in headers:  # the usual case: nothing more to read
        return from_body
    try:
        from_headers = VersionConstraint(min_version=_header_version(headers, MIN_HEADER),
                                         exact_version=_header_version(headers, EXACT_HEADER))
    except ValueError as exc:
        raise InvalidInput(f"headers {MIN_HEADER} and {EXACT_HEADER}: {exc}") from exc
    if from_body != VersionConstraint() and from_headers != VersionConstraint() and from_body != from_headers:
        raise InvalidInput(f"body asks for {from_body.describe()} but headers ask for {from_headers.describe()}")
    return from_body if from_body != VersionConstraint() else from_headers


def _header_version(headers: Mapping[str, str], name: str) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    version = parse_version(raw.strip())
    if version is None:
        raise InvalidInput(f"header {name} must be a non-negative integer, got {raw!r}")
    return version


def constraint_json(constraint: VersionConstraint) -> dict[str, int | str]:
    return {k: v for k, v in asdict(constraint).items() if v is not None}


# --------------------------------------------------------------------------- served versions


def violates(start: int | None, end: int | None, constraint: VersionConstraint, run_id: str | None = None) -> bool:
    """Whether a sample served from ``start`` to ``end`` (by a worker of run ``run_id``) breaks
    ``constraint``: its start does not satisfy it, or (``min_version``) it ended below the
    minimum, so it started below too."""
    if not satisfies(start, constraint, run_id):
        return True
    return constraint.min_version is not None and end is not None and end < constraint.min_version


def annotate_served_versions(meta: dict, dispatch_version: int | None, worker: Worker) -> int | None:
    """Add served start/end versions (ints) and the worker URL; returns the start version."""
    if "weight_version_start" in meta:
        start = parse_version(meta["weight_version_start"])
    else:
        start = dispatch_version
    if "weight_version_end" in meta:
        end = parse_version(meta["weight_version_end"])
    elif "weight_version" in meta:
        end = parse_version(meta["weight_version"])
    else:
        end = worker.weight_version
    meta.update(weight_version_start=start, weight_version_end=end, routed_worker=worker.url)
    return start
