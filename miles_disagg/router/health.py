"""Health checks: probe every worker's ``/health`` and ``/model_info`` (its ``weight_version``, and the older
LoRA adapter versions it keeps resident: ``resident_weight_versions``) each interval.

One pass at a time; within a pass the workers' probes start spread over the interval and run
concurrently, each bounded by the client's timeout, so one hung worker never delays the others' checks. A refused
connection or an error status takes a worker out of routing at once; timeouts count
towards the registry's failure threshold. A later successful probe brings it back with
the version it reads. A server without ``/model_info`` (404) is healthy with an unknown
version (it then serves only unconstrained requests). ``/model_info`` and not
``/get_weight_version``: SGLang 0.5.20 answers the latter 404 and later releases dropped it.
Probes carry the router's key for each path (:meth:`~miles_disagg.net.auth.ApiKeys.headers_for`):
the worker's own answer to an authenticated call is the only source of its version.
Probes go through the proxy's own client (:class:`~miles_disagg.router.upstream.UpstreamClient`, a second
instance with the probe timeout): httpx's pool scans every pooled connection per request, so a pass over
N workers cost O(N^2) (with 256 workers three fifths of the router's CPU), and aiohttp's layers cost about
three times this client's per probe (py-spy, ``miles-disagg bench scale``; 1,024 idle workers are 2,048
probes a second).

A pass skips a ``ready`` worker that answered a proxied request within the last :data:`SKIP_WINDOW_PASSES`
intervals (``last_answer``: over every process of the router): it is alive, and its answers carry its version
(a newer one moves the router's view forward; an older one makes its next probe due,
:attr:`~miles_disagg.router.registry.Worker.probe_due`). At most :data:`MAX_SKIPPED_PASSES` passes in a row
skip one worker. So under load the probes' cost no longer grows with the pool (at 256 workers they were a
tenth of the router's CPU, py-spy; at 1,024 workers, each answering a request every few seconds, an
interval's window still probed most of them); an idle pool is probed as before. What a skipped probe would
have found sooner: a worker that hangs (accepts but never answers) is taken out up to that window later (a
refused connection or an error answer still takes it out at the request that meets it). A probe timeout of a
worker that answered a proxied request while the probe ran is not counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from miles_disagg.net.asgi_guard import SERVER_ID_HEADER
from miles_disagg.net.auth import ApiKeys
from miles_disagg.net.pooled_http import ConnectTimedOut, NotConnected, Reply, TimedOut, TransportFailed
from miles_disagg.router.loop_lag import LoopLag
from miles_disagg.router.registry import Worker, WorkerRegistry, WorkerState, parse_older_versions, parse_version
from miles_disagg.router.upstream import UpstreamClient
from miles_disagg.types import MilesDisaggError

log = logging.getLogger(__name__)
PROBE_WAVES = 4
SKIP_WINDOW_PASSES = 5
MAX_SKIPPED_PASSES = 9


class ProbeFailed(MilesDisaggError):
    """A probe did not find the worker healthy; ``definite`` unless it was a timeout."""

    def __init__(self, message: str, *, definite: bool):
        self.definite = definite
        super().__init__(message)


class HealthChecker:
    """Periodic prober over a :class:`WorkerRegistry` (``client`` carries the probe timeout)."""

    def __init__(self, registry: WorkerRegistry, client: UpstreamClient, *, interval_s: float,
                 keys: ApiKeys | None = None, own_server_id: str | None = None,
                 loop_lag: LoopLag | None = None, timeout_s: float | None = None,
                 last_answer: Callable[[Worker], float | None] | None = None):
        """``own_server_id``: this router's (:data:`~miles_disagg.net.asgi_guard.SERVER_ID_HEADER`); a worker
        answering with it is the router itself under another address, never routed to. ``loop_lag`` and
        ``timeout_s`` (the probe timeout): a probe timeout while the loop lagged is not counted
        (:mod:`miles_disagg.router.loop_lag`). ``last_answer``: when a worker last answered a proxied request
        (``time.monotonic``; default: this process's own record of it)."""
        self.loop_lag, self.timeout_s = loop_lag, timeout_s
        self.last_answer = last_answer or (lambda worker: worker.last_answer_at)
        self._skipped: dict[Worker, int] = {}  # passes in a row that skipped the worker
        self.own_server_id = own_server_id
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.keys = keys or ApiKeys()

    async def run_forever(self) -> None:
        """Probe every worker once per ``interval_s`` until cancelled (the owner runs the first pass
        itself, all at once, before it serves); a pass starts its probes in :data:`PROBE_WAVES` waves
        spread over the interval. Waves, not one burst: 2 x 256 probes at once hold the event loop;
        not one probe at a time either: a wake-up per probe cost 2.5-3x the CPU of a burst."""
        while True:
            try:
                await self.check_spread(self.interval_s)
            except Exception:  # a bug here must not stop health checking for good
                log.exception("health pass failed")
                await asyncio.sleep(self.interval_s)

    async def check_spread(self, over_s: float, waves: int | None = None) -> None:
        """One pass: the workers in ``waves`` groups, one started every ``over_s / waves``; returns
        when the last probe has finished (one pass at a time). Workers that answered within ``over_s``
        are skipped (see the module docstring)."""
        workers = self.due(self.registry.workers(), SKIP_WINDOW_PASSES * over_s)
        waves = max(1, min(waves or PROBE_WAVES, len(workers)))
        probes = []
        for wave in range(waves):
            await asyncio.sleep(over_s / waves)
            probes += [asyncio.create_task(self.check(w)) for w in workers[wave::waves]]
        await asyncio.gather(*probes)

    def due(self, workers: list[Worker], within_s: float) -> list[Worker]:
        """The workers a pass probes: all but the ``ready`` ones that answered within ``within_s``, no probe
        due, skipped fewer than :data:`MAX_SKIPPED_PASSES` passes in a row."""
        now = time.monotonic()
        skipped, due = {}, []
        for worker in workers:
            answered = self.last_answer(worker)
            times = self._skipped.get(worker, 0)
            if (answered is not None and now - answered <= within_s and not worker.probe_due
                    and worker.state is WorkerState.READY and times < MAX_SKIPPED_PASSES):
                skipped[worker] = times + 1
            else:
                due.append(worker)
        self._skipped = skipped
        return due

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.registry.workers()))

    async def check(self, worker: Worker) -> None:
        """Probe one worker and record the outcome in the registry."""
        ticket = self.registry.ticket(worker)
        before = worker.state
        started, started_at = asyncio.get_running_loop().time(), time.monotonic()
        try:
            version, older = await self.probe(worker.url)
        except ProbeFailed as exc:
            if not exc.definite and self._lagged_since(started):
                log.info("worker %s: probe timed out while this router's loop lagged; not counted", worker.url)
                return
            if not exc.definite and (self.last_answer(worker) or 0.0) >= started_at:
                return  # it answered a proxied request meanwhile (maybe through another router process)
            self.registry.record_probe_failure(worker, str(exc), definite=exc.definite, ticket=ticket)
        else:
            self.registry.record_probe_ok(worker, version, ticket, older)
        if worker.state is not before:
            level = logging.WARNING if worker.state is WorkerState.UNHEALTHY else logging.INFO
            log.log(level, "worker %s: %s -> %s (version %s%s)", worker.url, before.value, worker.state.value,
                    worker.weight_version, f"; {worker.last_error}" if worker.last_error else "")

    def _lagged_since(self, started: float) -> bool:
        return self.loop_lag is not None and self.timeout_s is not None and self.loop_lag.excuses(started, self.timeout_s)

    async def probe(self, url: str) -> tuple[int | None, dict[int, str]]:
        """The worker's version and its older resident versions if ``/health`` answers 200; ``ProbeFailed``
        otherwise (a malformed ``resident_weight_versions`` too)."""
        health = await self._get(url, "/health")
        if self.answers_as_self(health):
            raise ProbeFailed("it answers as this router itself (an alias of its own address): requests would loop",
                              definite=True)
        if health.status_code != 200:
            raise ProbeFailed(f"/health answered {health.status_code}: {health.text[:200]}", definite=True)
        answer = await self._get(url, "/model_info")
        if answer.status_code == 404:
            return None, {}
        if answer.status_code != 200:
            raise ProbeFailed(f"/model_info answered {answer.status_code}: {answer.text[:200]}", definite=True)
        try:
            info = answer.json()
            version = parse_version(info.get("weight_version"))
            return version, parse_older_versions(info.get("resident_weight_versions"), version)
        except (ValueError, AttributeError) as exc:
            raise ProbeFailed(f"/model_info answered {answer.text[:200]!r}: {exc}", definite=True)

    def answers_as_self(self, reply: Reply) -> bool:
        return self.own_server_id is not None and reply.headers.get(SERVER_ID_HEADER) == self.own_server_id

    async def is_self(self, url: str) -> bool:
        """Whether ``url`` reaches this router itself (False when it cannot be reached now: the
        probes then keep checking)."""
        try:
            return self.answers_as_self(await self.client.get(url, "/health"))
        except TransportFailed:
            return False

    async def _get(self, url: str, path: str) -> Reply:
        try:
            return await self.client.get(url, path, self.keys.headers_for(path))
        except (TimedOut, ConnectTimedOut) as exc:
            raise ProbeFailed(f"GET {path} timed out ({exc})", definite=False) from exc
        except NotConnected as exc:
            raise ProbeFailed(f"GET {path}: cannot connect ({exc})", definite=True) from exc
        except TransportFailed as exc:
            raise ProbeFailed(f"GET {path} failed: {type(exc).__name__}: {exc}", definite=False) from exc
