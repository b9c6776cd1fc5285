"""The gateway: the version-aware router in service mode. ONE endpoint for rollout requests.

Generation is exactly the router's (:mod:`miles_disagg.router.app`): ``POST /generate``
(SGLang body) with ``"weight_version": {"min_version": N}`` or ``{"exact_version": N}``
(or the ``X-Weight-Version-Min``/``-Exact`` headers); only ready replicas that satisfy
the constraint are used; none ready: ``409 WeightVersionNotReady`` (or ``503`` when no
replica is ready at all), both ``retryable: true`` with ``Retry-After``; never an older
policy. Every answer carries ``meta_info.weight_version_start``/``weight_version_end``
(both differ when an activation happened while the request was in flight; the request
is not broken by it) and ``meta_info.routed_worker``.

Service additions:

* ``POST /heartbeat`` (a :class:`~miles_disagg.service.protocol.ReplicaStatus`): replicas
  register and report state, acknowledged version and run, staging, load. A replica's engine
  is routed to only while it reports ``ready`` and the engine itself, probed with the
  gateway's key, reports the version the replica acknowledged; the registry takes versions
  only from the engine, and the run id from the (admin-authenticated) heartbeat. A request
  whose constraint names a ``run_id`` is served only by replicas of that run.
* ``GET /service_info``: what the replicas serve, full-weight versions or the LoRA adapter
  versions of one adapter chain (``lora_base_dir``, its version 0: ``serve gateway
  --lora-base-dir``); a run checks it before step 1. A heartbeat naming another chain (or one
  where the gateway has none, or none where it has one) is refused (400): that replica is
  never routed to.
* ``POST /deregister`` ``{"replica_id"}``: a replica leaves (after draining).
* ``POST /wake``: asks every replica to reconcile now (``POST {replica}/wake``, concurrently,
  best effort); a publisher may call it after publishing, polling converges anyway.
* ``GET /replicas``: the fleet table; ``GET /service_metrics``: convergence per version,
  per-replica prepare/pause times, request counts and version lag, gateway overhead,
  and the load an autoscaler reads (``load.in_flight``, ``load.num_replicas``, ...).

Keys (:mod:`miles_disagg.net.asgi_guard`): ``/heartbeat``, ``/deregister`` and ``/wake`` need the
admin key (as the router's registry endpoints do); the gateway sends its keys to replicas and
engines.

Replicas silent for ``heartbeat_timeout_s`` are taken out of routing; after
``forget_after_s`` they are removed. Gateway state is soft: a restarted gateway learns
the fleet again from the next heartbeats.
"""

# no "from __future__ import annotations": FastAPI must see the real Request class

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi.responses import JSONResponse

from miles_disagg.net.asgi_guard import ServerGuard
from miles_disagg.net.httpjson import error_json, parse_body, status_for
from miles_disagg.net.keyed_client import shared_tls_context
from miles_disagg.router.app import create_app
from miles_disagg.router.config import RouterConfig
from miles_disagg.router.proxy import ProxyRecord, Router
from miles_disagg.router.registry import UnknownWorker
from miles_disagg.service.fleet import Fleet
from miles_disagg.service.metrics import DEFAULT_FRACTIONS, ConvergenceTracker, RequestStats, summary
from miles_disagg.service.protocol import SERVICE_INFO_PATH, Deregistration, ReplicaStatus
from miles_disagg.types import InvalidInput

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """Settings of one gateway process (the router's plus the service's)."""

    router: RouterConfig = field(default_factory=RouterConfig)
    """Routing, health checks and Retry-After (the router's own settings)."""
    heartbeat_timeout_s: float = 3.0
    """A replica silent this long is out of routing and out of the capacity."""
    forget_after_s: float = 60.0
    """A replica silent this long is removed with its worker."""
    expire_interval_s: float = 0.25
    """Seconds between liveness checks of the fleet."""
    wake_timeout_s: float = 2.0
    """Timeout of each ``POST {replica}/wake`` of a fan-out."""
    convergence_fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    """Capacity fractions whose convergence time is reported per version."""
    lora_base_dir: str | None = None
    """The adapter chain (its version 0) whose LoRA adapter versions the replicas serve: only replicas
    naming it are taken (None: full-weight versions, only replicas naming none)."""

    def __post_init__(self) -> None:
        for name in ("heartbeat_timeout_s", "forget_after_s", "expire_interval_s", "wake_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.forget_after_s < self.heartbeat_timeout_s:
            raise ValueError("forget_after_s must be >= heartbeat_timeout_s")


class Gateway:
    """Fleet table + metrics over a :class:`Router`; lives on the router's event loop."""

    def __init__(self, router: Router, config: GatewayConfig):
        self.router, self.config = router, config
        self.fleet = Fleet(timeout_s=config.heartbeat_timeout_s, forget_s=config.forget_after_s)
        self.convergence = ConvergenceTracker(config.convergence_fractions)
        self.requests = RequestStats()
        router.observers.append(self._observe)

    def _observe(self, record: ProxyRecord) -> None:
        head = self.fleet.newest_head()
        self.requests.observe(record.status, record.constraint, record.served, head.version if head else None,
                              record.total_s, record.upstream_s)

    async def heartbeat(self, status: ReplicaStatus) -> dict:
        """Apply one heartbeat to the fleet and the router (registration on first contact)."""
        refusal = chain_mismatch(self.config.lora_base_dir, status.lora_base_dir)
        if refusal is not None:
            raise InvalidInput(f"replica {status.replica_id}: {refusal}")
        applied = self.fleet.apply(status, time.monotonic(), time.time())
        if applied is None:
            return {"accepted": False, "reason": "stale heartbeat (an older seq of this incarnation)"}
        registry = self.router.registry
        if applied.dropped_url:
            log.info("replica %s moved from %s to %s", status.replica_id, applied.dropped_url, applied.engine_url)
            self._remove_worker(applied.dropped_url)
        worker = None
        if applied.engine_url:
            new = not _registered(registry, applied.engine_url)
            worker = registry.add(applied.engine_url)
            if new:
                log.info("replica %s registered (engine %s, %s)", status.replica_id, worker.url, status.state.value)
            claimed = applied.weight_version
            if new or (claimed is not None and claimed != worker.weight_version):
                await self.router.health.check(worker)  # the engine's own answer, never the claim
            state = applied.worker_state
            if state == "ready" and claimed is not None and worker.weight_version != claimed:
                state = "paused"  # the engine does not report what the replica acknowledged (yet)
            registry.set_admin_state(worker.url, state, run_id=status.run_id if claimed is not None else None)
        self.convergence.observe_head(status.store_head)
        self.convergence.observe_fleet(self.fleet.capacity(), time.time())
        return {"accepted": True, "worker": None if worker is None else worker.to_json()}

    def info(self) -> dict:
        """:data:`~miles_disagg.service.protocol.SERVICE_INFO_PATH`'s answer: what every replica serves."""
        chain = self.config.lora_base_dir
        return {"serves": "lora_adapter_versions" if chain else "full_weight_versions", "lora_base_dir": chain}

    def deregister(self, replica_id: str) -> dict:
        entry = self.fleet.remove(replica_id)
        if entry is None:
            raise InvalidInput(f"no replica {replica_id!r} is registered")
        if entry.status.engine_url:
            self._remove_worker(entry.status.engine_url)
        self.convergence.observe_fleet(self.fleet.capacity(), time.time())
        log.info("replica %s deregistered", replica_id)
        return {"replica_id": replica_id}

    def _remove_worker(self, url: str) -> None:
        with contextlib.suppress(UnknownWorker):
            self.router.registry.remove(url)

    async def expire_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.expire_interval_s)
            try:
                self.expire_once()
            except Exception:  # a bug here must not stop liveness checks for good
                log.exception("fleet expiry pass failed")

    def expire_once(self) -> None:
        for expired in self.fleet.expire(time.monotonic()):
            log.warning("replica %s silent: %s", expired.replica_id, "forgotten" if expired.forgotten else "out of routing")
            if expired.engine_url is None:
                continue
            if expired.forgotten:
                self._remove_worker(expired.engine_url)
            elif _registered(self.router.registry, expired.engine_url):
                self.router.registry.set_admin_state(expired.engine_url, "paused")
        self.convergence.observe_fleet(self.fleet.capacity(), time.time())

    async def wake(self) -> dict:
        """``POST /wake`` on every live replica at once; returns who answered."""
        urls = self.fleet.control_urls()
        headers = self.router.keys.headers_for("/wake")
        async with httpx.AsyncClient(timeout=self.config.wake_timeout_s, trust_env=False,
                                     verify=shared_tls_context()) as client:
            results = await asyncio.gather(*(client.post(f"{u}/wake", headers=headers) for u in urls),
                                           return_exceptions=True)
        woken, failed = [], {}
        for url, result in zip(urls, results):
            if isinstance(result, httpx.Response) and result.is_success:
                woken.append(url)
            else:
                failed[url] = f"{type(result).__name__}: {result}" if isinstance(result, BaseException) else result.status_code
        return {"woken": woken, "failed": failed}

    def metrics(self) -> dict:
        now = time.monotonic()
        workers = self.router.registry.workers()
        capacity = self.fleet.capacity()
        head = self.fleet.newest_head()
        replicas = []
        for entry in self.fleet.entries():
            item = entry.to_json(now)
            item["prepare_s"] = summary(a.prepare_s for a in entry.status.activations)
            item["pause_s"] = summary(a.pause_s for a in entry.status.activations)
            replicas.append(item)
        return {
            "newest_published": None if head is None else vars(head),
            "convergence": self.convergence.to_json(),
            "replicas": replicas,
            "requests": self.requests.to_json(),
            "load": {"in_flight": sum(w.outstanding for w in workers), "num_replicas": len(capacity),
                     "num_ready": sum(a is not None for a in capacity),
                     "num_unserved": self.requests.counts.get("no_replica_available", 0)},
        }


def chain_mismatch(ours: str | None, theirs: str | None) -> str | None:
    """Why a replica serving ``theirs`` (its adapter chain; None: full weights) cannot join a gateway
    serving ``ours``; None when it can."""
    if ours is None and theirs is None:
        return None
    if ours is None:
        return (f"it serves LoRA adapter versions from {theirs!r} and this gateway full-weight versions; "
                "start the gateway with --lora-base-dir too")
    if theirs is None:
        return (f"it serves full-weight versions and this gateway LoRA adapter versions from {ours!r}; "
                f"start the replica with --lora-base-dir {ours}")
    if os.path.realpath(theirs) != os.path.realpath(ours):
        return f"it serves the adapter chain at {theirs!r}, this gateway the one at {ours!r}"
    return None


def _registered(registry, url: str) -> bool:
    try:
        registry.get(url)
        return True
    except UnknownWorker:
        return False


def create_gateway_app(config: GatewayConfig, guard: ServerGuard | None = None):
    """The router's app with the service endpoints; its lifespan also runs the fleet expiry.
    ``guard``: keys and request limit (None: keys from the environment, the default limit)."""
    from fastapi import Request

    app = create_app(config.router, guard=guard)
    gateway = Gateway(app.state.router, config)
    app.state.gateway = gateway
    router_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_):
        async with router_lifespan(app_):
            task = asyncio.create_task(gateway.expire_forever())
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    app.router.lifespan_context = lifespan

    async def answer(handler, request: Request):
        try:
            return await handler(await request.body())
        except Exception as exc:  # typed errors -> their statuses; the rest 500, logged
            status = status_for(exc)
            return JSONResponse(error_json(exc, status), status_code=status)

    @app.post("/heartbeat")
    async def heartbeat(request: Request):
        return await answer(lambda body: gateway.heartbeat(ReplicaStatus.from_json(body)), request)

    @app.post("/deregister")
    async def deregister(request: Request):
        async def handler(body: bytes) -> Any:
            return gateway.deregister(parse_body(Deregistration, body).replica_id)
        return await answer(handler, request)

    @app.post("/wake")
    async def wake():
        return await gateway.wake()

    @app.get("/replicas")
    async def replicas():
        now = time.monotonic()
        return {"replicas": [e.to_json(now) for e in gateway.fleet.entries()]}

    @app.get(SERVICE_INFO_PATH)
    async def service_info():
        return gateway.info()

    @app.get("/service_metrics")
    async def service_metrics():
        return gateway.metrics()

    return app
