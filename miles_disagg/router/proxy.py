"""The router's core: :class:`Router` (worker registry + policy + health checker + proxy) on one event loop.

Generation (each request proxied to one worker; the HTTP app, :mod:`miles_disagg.router.app`, hands
``POST /generate`` (PUT too), ``POST /v1/completions`` and ``POST /v1/chat/completions`` to
:meth:`Router.proxy`). A version constraint comes from the body key ``"weight_version":
{"min_version": N}`` or ``{"exact_version": N}`` (removed before forwarding; the engine does not know
it) or from the headers ``X-Weight-Version-Min`` / ``X-Weight-Version-Exact``; giving both,
differently, is a 400. ``stream: true`` on ``/generate`` is relayed as the engine streams it
(:mod:`~miles_disagg.router.streams`); on the OpenAI routes it is a 400.

Contracts:

* Routing: only ``ready`` workers whose known version satisfies the constraint, fewest
  outstanding requests first (:mod:`miles_disagg.router.policy`); a request with a routing key
  (``X-SMG-Routing-Key``) goes to the worker that served that key last while it can take it
  (:mod:`miles_disagg.router.affinity`; moves counted). None ready: 503
  ``NoWorkerAvailable``; ready ones but none satisfying: 409 ``WeightVersionNotReady``
  with ``required`` and ``available_versions``. Both carry ``Retry-After`` and
  ``retryable: true``. An older policy than the constraint allows is never used.
* Served versions: every 2xx ``/generate`` item gets ``meta_info.weight_version_start`` /
  ``weight_version_end`` (ints, null if unknown) and ``meta_info.routed_worker``; the engine's
  own start/end win, else start is the worker's version at dispatch and end the response's
  ``weight_version``. OpenAI responses get the same keys in ``metadata``. If the served start
  version does not satisfy the constraint (the router's view was stale) the answer is a 409
  instead of that sample; the version seen in every response updates the registry.
* Failures: a refused connection (nothing was sent) marks the worker unhealthy and the
  request is tried on another worker; so does a connect timeout, except that a worker which
  answered a request within the connect timeout, or whose connect timed out while the router's own
  loop lagged (:mod:`~miles_disagg.router.loop_lag`), stays in routing (its probes decide). A request
  never tries the same worker twice. Any later failure (connection lost, timeout, 5xx)
  marks the worker unhealthy and answers 502 ``WorkerFailed`` (retryable). A request that
  may have started generating is never replayed, ``rid`` or not. 4xx answers pass through.
* A client that disconnects has its upstream request closed, so the engine aborts it
  (:mod:`~miles_disagg.router.client_gone`).
* Keys: towards workers the router sends its own keys, never the client's, and never above the
  level the client proved. Big bodies are parsed and re-encoded off the event loop.

A router of several processes on one port (``--router-workers N``) routes in each of them from one
view of the workers, which only its leader changes (:mod:`miles_disagg.router.peers`): a follower's news
of a worker (a failure, a version in an answer) reach routing through the leader.

A worker's version is learned only from the worker (probes and its answers): a ``weight_version``
given to :meth:`Router.set_worker_state` is checked against a probe of the worker and refused
(``WorkerVersionMismatch``, nothing changed) when the worker reports another.

Observers (``Router.observers``, used by the rollout service's gateway): each is called
with a :class:`ProxyRecord` once per generation request that got past parsing, after its
answer is decided, on the event loop; an observer that raises is logged and ignored.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi.responses import Response

from miles_disagg.net.auth import ApiKeys, forward_headers
from miles_disagg.net.httpjson import parse_json_async
from miles_disagg.net.pooled_http import ConnectTimedOut, NotConnected, Reply, TransportFailed
from miles_disagg.router.affinity import choose_for_session, routing_key
from miles_disagg.router.client_gone import ClientGone, unless_client_gone
from miles_disagg.router.config import RouterConfig
from miles_disagg.router.health import HealthChecker
from miles_disagg.router.hops import HOPS_HEADER, LOOP_DETECTED, RouterLoop, hops_of
from miles_disagg.router.loop_lag import LoopLag
from miles_disagg.router.peers import SoleRouter
from miles_disagg.router.policy import (LeastOutstandingPolicy, NoWorkerAvailable, annotate_served_versions,
                                       constraint_json, request_constraint, version_served, violates)
from miles_disagg.router.registry import Worker, WorkerRegistry, WorkerState, normalize_url, parse_version
from miles_disagg.router.replies import (encode, encode_async, error_response, json_or_none, metas_of, payload_for,
                                        percentiles_ms)
from miles_disagg.router.shared_table import COUNTERS as METRIC_COUNTERS
from miles_disagg.router.streams import StreamRelay, dispatch_stream
from miles_disagg.router.upstream import UpstreamClient
from miles_disagg.types import InvalidInput, Retryable, VersionConstraint, VersionNotReady

log = logging.getLogger(__name__)

GENERATE_PATH = "/generate"
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")
OVERHEAD_WINDOW = 100_000  # routing overheads kept for /metrics' percentiles (the most recent requests)


class WorkerFailed(Retryable):
    """The worker failed while serving the request; it is out of routing, the request may be retried."""

    def __init__(self, url: str, reason: str):
        self.url = url
        super().__init__(f"worker {url} failed: {reason}")


class WorkerVersionMismatch(Retryable):
    """A caller said a worker holds a version the worker itself does not report (409)."""

    def __init__(self, url: str, expected: int, actual: int | None):
        self.url, self.expected, self.actual = url, expected, actual
        super().__init__(f"worker {url} reports weight version {actual}, not {expected}; the router learns versions "
                         "only from the worker itself")


@dataclass
class ProxyRecord:
    """One proxied generation request, as observers see it."""

    constraint: VersionConstraint
    status: int = 0
    served: list[tuple[int | None, int | None]] = field(default_factory=list)  # (start, end) per item
    worker: str | None = None  # the worker that answered (the last one tried)
    total_s: float = 0.0  # in the router, from the body read to the answer
    upstream_s: float = 0.0  # waiting for workers (every try)
    routing_key: str | None = None  # the session it belongs to (router/affinity.py), if it named one
    stream: bool = False  # "stream": true: the worker's SSE answer relayed as it comes (router/streams.py)


class Router:
    """Registry + policy + health checker + proxy; lives on one event loop.

    ``peers``: the router's other processes, when it is one of several on one port
    (:mod:`miles_disagg.router.peers`; default: it is the only one); the hot path tells it what it learns
    of a worker and asks it for the latest view before each routing decision."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry | None = None, keys: ApiKeys | None = None,
                 peers: Any = None):
        self.config = config
        self.keys = keys or ApiKeys()  # sent to workers (one key set per deployment)
        if registry is None:
            registry = WorkerRegistry(failure_threshold=config.health_failure_threshold)
        self.registry = registry
        self.peers = peers if peers is not None else SoleRouter(self.registry)
        self.policy = LeastOutstandingPolicy()
        self.counters: Counter[str] = Counter()
        self._client: UpstreamClient | None = None
        self.streams: StreamRelay | None = None  # "stream": true requests (router/streams.py)
        self.health: HealthChecker | None = None
        self._health_task: asyncio.Task | None = None
        self._lag_task: asyncio.Task | None = None
        self.loop_lag = LoopLag()
        self.observers: list[Callable[[ProxyRecord], None]] = []
        self.overheads_s: collections.deque[float] = collections.deque(maxlen=OVERHEAD_WINDOW)
        self.server_id: str | None = None  # the app's (asgi_guard): a worker answering with it is this router
        self._headers: dict[tuple[Any, str], dict[str, str]] = {}  # (caller's level, path) -> headers towards workers

    async def start(self, *, probes: bool = True) -> None:
        """Open the HTTP clients, register ``config.workers``, run one health pass, start the loop
        (``probes`` False: a follower process, which only routes; its view comes from the leader)."""
        # Requests and probes to workers: upstream.UpstreamClient (its module and health.py say why). Idle
        # connections are dropped before the engine side closes them (a closing connection would read as a
        # worker failure); worker traffic never goes through an env proxy.
        self._client = UpstreamClient(connect_timeout_s=self.config.connect_timeout_s,
                                      read_timeout_s=self.config.request_timeout_s)
        self.streams = StreamRelay(connect_timeout_s=self.config.connect_timeout_s,
                                   read_timeout_s=self.config.request_timeout_s)
        self._lag_task = asyncio.create_task(self.loop_lag.run_forever())
        if not probes:
            return
        timeout = self.config.health_check_timeout_s
        probe_client = UpstreamClient(connect_timeout_s=timeout, read_timeout_s=timeout)
        self.health = HealthChecker(self.registry, probe_client, interval_s=self.config.health_check_interval_s,
                                    keys=self.keys, own_server_id=self.server_id, loop_lag=self.loop_lag,
                                    timeout_s=timeout, last_answer=self.peers.last_answer_at)
        for url in self.config.workers:
            self.peers.check_admission(url)
            self.registry.add(url)
        await self.health.check_all()
        self._health_task = asyncio.create_task(self.health.run_forever())

    async def stop(self) -> None:
        for task in (self._health_task, self._lag_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for client in (self._client, self.health and self.health.client, self.streams):
            if client is not None:
                await client.aclose()

    # ------------------------------------------------------------------ registry operations

    async def add_worker(self, url: str) -> Worker:
        """Register ``url`` and probe it at once, so a live engine is ``ready`` on return. ``InvalidInput``
        (nothing registered) when ``url`` reaches this router itself (or its gateway): requests would loop."""
        url = normalize_url(url)
        if await self.health.is_self(url):
            raise InvalidInput(f"{url} is this router itself (or an alias of its address); a router cannot be its "
                               "own worker: requests would loop through it")
        self.peers.check_admission(url)
        worker = self.registry.add(url)
        await self.health.check(worker)
        return worker

    async def set_worker_state(self, url: str, state: str, weight_version: int | None) -> Worker:
        """Set the admin state; marking ``ready`` re-reads the version from the worker first, so
        requests are routed by the version the engine holds after its update. A ``weight_version``
        is only an expectation: ``WorkerVersionMismatch`` (nothing changed) when the worker reports another."""
        worker = self.registry.get(url)
        if weight_version is not None:
            await self.health.check(worker)
            if worker.weight_version != weight_version:
                raise WorkerVersionMismatch(worker.url, weight_version, worker.weight_version)
        worker = self.registry.set_admin_state(url, state)
        if worker.admin_state is WorkerState.READY and weight_version is None:
            await self.health.check(worker)
        return worker

    # ------------------------------------------------------------------ proxy

    async def proxy(self, request: Any, path: str) -> Any:
        """Route one generation request (see the module docstring for the contract)."""
        self.counters["requests"] += 1
        try:
            hops = hops_of(request.headers)  # routers it went through: a loop of routers ends here
            raw = await request.body()
            body = await parse_json_async(raw)
            constrained_in_body = "weight_version" in body
            constraint = request_constraint(body, request.headers)
            key = routing_key(request.headers)
            stream = bool(isinstance(body, dict) and body.get("stream"))
            if stream and path != GENERATE_PATH:
                raise InvalidInput(f"stream=true is relayed for {GENERATE_PATH} only; send stream=false to {path}")
        except RouterLoop as exc:
            return error_response(LOOP_DETECTED, exc, hops=exc.hops, limit=exc.limit)
        except InvalidInput as exc:
            return error_response(400, exc)
        record = ProxyRecord(constraint, routing_key=key, stream=stream)
        started = time.perf_counter()
        # the body goes on as it came unless its constraint had to be taken out; a session's /generate
        # without a cache namespace gets the served version's (router/affinity.py), so it is encoded per worker
        keyed = key is not None and path == GENERATE_PATH and isinstance(body, dict) and "extra_key" not in body
        payload = await encode_async(body, len(raw)) if constrained_in_body else raw
        exact_body = body if constraint.exact_version is not None else None  # may be pinned to an older adapter
        response = await self._route(request, path, payload, record, hops, body if keyed else None, exact_body)
        record.status, record.total_s = response.status_code, time.perf_counter() - started
        overhead_s = record.total_s - record.upstream_s
        self.overheads_s.append(overhead_s)
        self.peers.record_overhead(overhead_s)
        if self.observers:
            self._notify(record)
        return response

    async def _route(self, request: Any, path: str, payload: bytes, record: ProxyRecord, hops: int = 0,
                     keyed_body: dict | None = None, exact_body: dict | None = None) -> Any:
        constraint = record.constraint
        level = getattr(request.state, "auth_level", None)
        keyed = self._headers.get((level, path))
        if keyed is None:
            keyed = self._headers[(level, path)] = {"Content-Type": "application/json",
                                                    **forward_headers(self.keys, level, path)}
        headers = {**keyed, HOPS_HEADER: str(hops + 1)}  # router/hops.py: one more than it came with
        tried: set[Worker] = set()
        for _ in range(len(self.registry) + 1):
            self.peers.sync()  # another process's news first (a no-op for a router that is one process)
            try:
                worker = self._choose(record, tried)
            except (VersionNotReady, NoWorkerAvailable) as exc:
                return self._not_ready(exc, constraint)
            sent = payload_for(worker, payload, constraint, keyed_body, exact_body)
            dispatch = self._dispatch_stream if record.stream else self._dispatch
            response = await dispatch(worker, path, sent, headers, request, record)
            if response is not None:
                return response
            tried.add(worker)
        return self._not_ready(NoWorkerAvailable("every ready worker refused the connection"), constraint)

    def _choose(self, record: ProxyRecord, tried: set[Worker]) -> Worker:
        if record.routing_key is None:
            return self.policy.choose_in(self.registry, record.constraint, skip=tried)
        return choose_for_session(self.policy, self.registry, self.peers, record.routing_key, record.constraint,
                                  tried, self.counters)

    def _notify(self, record: ProxyRecord) -> None:
        for observer in self.observers:
            try:
                observer(record)
            except Exception:  # an observer must never break routing
                log.exception("proxy observer failed")

    async def _dispatch(self, worker: Worker, path: str, payload: bytes, headers: dict, request: Any,
                        record: ProxyRecord) -> Any:
        """Send to ``worker``; ``None`` if it could not be reached (nothing was sent)."""
        dispatch_version = version_served(worker, record.constraint)
        record.worker = worker.url
        self.registry.acquire(worker)
        self.peers.load_changed(worker)
        served = False
        sent_at, sent_loop_time = time.perf_counter(), asyncio.get_running_loop().time()
        try:
            send = self._client.post(worker.url, path, payload, headers)
            upstream = await unless_client_gone(request, send)
            if upstream.status_code == LOOP_DETECTED:  # a router of a loop: out of routing, its 508 relayed
                self._fail(worker, "it is a router in a routing loop (it answered 508 Loop Detected)")
            elif upstream.status_code >= 500:
                raise WorkerFailed(worker.url, f"{path} answered {upstream.status_code}: {upstream.text[:500]}")
            served = True
        except ClientGone:
            self.counters["client_disconnected"] += 1
            return Response(status_code=499)
        except ConnectTimedOut as exc:
            self.counters["connect_retries"] += 1
            if (self.registry.answered_within(worker, self.config.connect_timeout_s)
                    or self.loop_lag.excuses(sent_loop_time, self.config.connect_timeout_s)):
                self.counters["connect_timeouts_of_live_workers"] += 1  # busy, not gone: probes decide
            else:
                self._fail(worker, f"cannot connect: {exc}")
            return None
        except NotConnected as exc:
            self._fail(worker, f"cannot connect: {exc}")
            self.counters["connect_retries"] += 1
            return None
        except (TransportFailed, WorkerFailed) as exc:
            failure = exc if isinstance(exc, WorkerFailed) else WorkerFailed(worker.url, f"{type(exc).__name__}: {exc}")
            self._fail(worker, str(failure))
            self.counters["worker_failed"] += 1
            return error_response(502, failure, worker=worker.url)
        finally:
            record.upstream_s += time.perf_counter() - sent_at
            self.registry.release(worker, served=served)
            self.peers.load_changed(worker)
        return self._relay(worker, path, upstream, dispatch_version, record)

    async def _dispatch_stream(self, worker: Worker, path: str, payload: bytes, headers: dict, request: Any,
                               record: ProxyRecord) -> Any:
        refuse = lambda message: self._not_ready(VersionNotReady(record.constraint, [worker.weight_version]),  # noqa: E731
                                                 record.constraint, message=message)
        return await dispatch_stream(self.streams, self, worker, path, payload, headers, record, fail=self._fail,
                                     refuse=refuse)

    def _fail(self, worker: Worker, reason: str) -> None:
        log.warning("worker %s taken out of routing: %s", worker.url, reason)
        self.peers.mark_failed(worker, reason)

    def _relay(self, worker: Worker, path: str, upstream: Reply, dispatch_version: int | None,
               record: ProxyRecord) -> Any:
        """The worker's answer with served versions added (non-JSON or non-2xx: as is)."""
        constraint = record.constraint
        routed = {"X-Routed-Worker": worker.url}
        content_type = upstream.headers.get("content-type", "")
        obj = json_or_none(upstream) if upstream.is_success and "json" in content_type else None
        if obj is None:
            return Response(upstream.content, status_code=upstream.status_code,
                            media_type=content_type or None, headers=routed)
        metas = metas_of(obj, "meta_info" if path == GENERATE_PATH else "metadata")
        for meta in metas:
            self.peers.observe_version(worker, parse_version(meta.get("weight_version")))
        for meta in metas:
            annotate_served_versions(meta, dispatch_version, worker)
        wrong = [m for m in metas
                 if violates(m["weight_version_start"], m["weight_version_end"], constraint, worker.run_id)]
        if wrong:
            self.counters["stale_view"] += 1
            served = (wrong[0]["weight_version_start"], wrong[0]["weight_version_end"])
            message = (f"worker {worker.url} served versions {served} (start, end), which do not satisfy "
                       f"{constraint.describe()} (the router's view of it was stale); retry")
            available = [worker.weight_version] if worker.weight_version is not None else []
            return self._not_ready(VersionNotReady(constraint, available), constraint, message=message)
        record.served = [(m["weight_version_start"], m["weight_version_end"]) for m in metas]
        return Response(encode(obj), status_code=upstream.status_code, media_type="application/json", headers=routed)

    def _not_ready(self, exc: Retryable, constraint: VersionConstraint, message: str | None = None) -> Any:
        retry = {"Retry-After": str(max(1, math.ceil(self.config.retry_after_s)))}
        extra: dict[str, Any] = {"retry_after_s": self.config.retry_after_s}
        if isinstance(exc, VersionNotReady):
            self.counters["version_not_ready"] += 1
            extra.update(required=constraint_json(constraint), available_versions=exc.available)
            return error_response(409, exc, type_name="WeightVersionNotReady", headers=retry,
                                   message=message, **extra)
        self.counters["no_worker_available"] += 1
        return error_response(503, exc, headers=retry, worker_states=getattr(exc, "states", {}), **extra)

    def workers_json(self) -> list[dict[str, Any]]:
        """Every worker as ``/list_workers`` shows it (load over every process of the router)."""
        return [self.peers.worker_json(w) for w in self.registry.workers()]

    def metrics(self) -> dict[str, Any]:
        own = {**{k: self.counters.get(k, 0) for k in METRIC_COUNTERS},
               "served_per_worker": {w.url: w.num_served for w in self.registry.workers()},
               "routing_overhead_ms": percentiles_ms(self.overheads_s)}
        return self.peers.metrics(own)
