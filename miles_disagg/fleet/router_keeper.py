"""The run's router kept answering: its control calls retried, the router restarted when it stays unreachable.

Every control call the run makes to its router (register or remove a worker, mark one paused or
ready, wait for a worker's version, list them) goes through :class:`GuardedRouter`, which
:class:`RouterKeeper` backs:

* A call that cannot reach the router (``RouterUnreachable``: refused, reset, timed out) is tried
  again every :data:`RETRY_S` while the router's process is alive, for at most :data:`STALL_BOUND_S`
  after its first failure: a router stopped for a while (SIGSTOP, a starved core) answers again
  afterwards, and the call goes through then.
* A router whose process has exited, or that still does not answer after that bound, is restarted
  (:meth:`RouterKeeper.restart`): the old process is killed, a new one listens at the same address
  (so the rollout's requests find it again), every member engine that is not down is registered
  again from the run's record (the engine set's slots; the router reads each one's version from the
  engine itself, as it always does), and those the run had marked paused are marked paused again.
  The call is then made on the new router, within a new bound. One restart at a time: callers that
  failed on the same router share one (:attr:`RouterKeeper.generation`).
* The engine manager's monitor asks :meth:`RouterKeeper.check` each health-check interval: a router
  whose process exited is restarted at once, one that does not answer ``/health`` and has answered
  nothing (neither a probe nor a control call) for :data:`STALL_BOUND_S` is too, so a dead router does
  not wait for the next control call.

A restart is an event of the engine set (``router_restarted``, with why, in ``engine_events.json``)
and counted: ``rollout/router_restarts`` and ``rollout/router_call_retries`` in each update's metrics
(``docs/metrics.md``). A call still failing after a restart raises its error (an update then retries:
:meth:`~miles_disagg.fleet.manager.EngineManager.update_weights`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from miles_disagg.router.client import RouterUnreachable
from miles_disagg.types import MilesDisaggError

log = logging.getLogger(__name__)

STALL_BOUND_S = 45.0
"""How long a live router may leave the run's calls (or the monitor's ``/health``) unanswered before it is restarted."""
RETRY_S = 0.5
"""Pause between two tries of a control call the router did not answer."""
CALL_TIMEOUT_S = 15.0
"""One try of a control call (the client's timeout)."""
HEALTH_TIMEOUT_S = 5.0
"""One ``/health`` probe of the monitor."""
PAUSED_STATES = ("paused", "activating")


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` means the router did not answer (not that it refused a call)."""
    import httpx

    return isinstance(exc, (RouterUnreachable, httpx.TransportError))


class RouterKeeper:
    """Control calls to the router and its restarts (see the module docstring).

    ``routing``: the :class:`~miles_disagg.fleet.routing.EngineRouting` that owns the router process
    (``router``: ``url``, ``proc``, ``stop()``; ``raw_client``; ``relaunch(why)`` starts a new process at
    the same address, ``members()`` the URLs to register again); ``record``: appends an event to the
    engine set's events; ``stopping``: set when the run stops (no restart then)."""

    def __init__(self, routing: Any, record: Callable[[dict], None], stopping: threading.Event,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.routing, self.record, self.stopping = routing, record, stopping
        self.clock, self.sleep = clock, sleep
        self.generation = 0
        """How many times the router was started again (a caller's failure names the one it saw)."""
        self.restarts = 0
        self.call_retries = 0
        self.intended: dict[str, str] = {}
        """The state the run last set for each worker (``paused``/``ready``): what a restart restores."""
        self._restarting = threading.Lock()
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="router-launch")
        """Starts every new router process: a thread that lives as long as the keeper. The router
        gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG is per thread), so a
        restart made from a caller's short-lived thread would be killed again once that thread ends."""
        self.last_answered = clock()
        """When the router last answered the run (a control call or a probe)."""

    # ------------------------------------------------------------------ calls

    def call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)`` on the router, tried again and the router restarted as the module docstring says."""
        restarted = False
        first_failure: float | None = None
        while True:
            if self._restarting.locked():  # a restart is under way: the new router, once it is there
                with self._restarting:
                    pass
            generation, client, tried_at = self.generation, self.routing.raw_client, self.clock()
            try:
                answer = fn(client)
                self.last_answered = self.clock()
                return answer
            except Exception as exc:  # noqa: BLE001 - only "did not answer" is retried; the rest propagates
                if not unreachable(exc) or self.stopping.is_set():
                    raise
                now = self.clock()
                first_failure = tried_at if first_failure is None else first_failure
                if self.process_alive() and now - first_failure < STALL_BOUND_S:
                    self.call_retries += 1
                    self.sleep(RETRY_S)
                    continue
                if restarted:
                    raise RouterUnreachable(f"{what}: the router did not answer, also after it was restarted "
                                            f"({type(exc).__name__}: {exc})") from exc
                self.restart(generation, why=self.why_unreachable(now - first_failure, exc))
                restarted, first_failure = True, None

    def process_alive(self) -> bool:
        router = self.routing.router
        return router is not None and router.proc.poll() is None

    def why_unreachable(self, silent_s: float, exc: BaseException) -> str:
        router = self.routing.router
        code = router.proc.poll() if router is not None else None
        if code is not None:
            return f"its process exited (code {code})"
        return f"it did not answer for {silent_s:.0f}s ({type(exc).__name__}: {exc})"

    # ------------------------------------------------------------------ restart

    def restart(self, generation: int, why: str) -> None:
        """Start the router again (unless someone did since ``generation``) and register the members."""
        with self._restarting:
            if self.generation != generation or self.stopping.is_set():
                return  # another caller restarted it already (or the run stops)
            log.warning("the router at %s is restarted: %s", self.routing.router.url, why)
            started = self.clock()
            self._launcher.submit(self.routing.relaunch).result()
            registered = self._register_members()
            self.generation += 1
            self.restarts += 1
            self.last_answered = self.clock()
            self.record({"event": "router_restarted", "why": why, "url": self.routing.router.url,
                         "workers": registered, "restart_s": round(self.clock() - started, 3), "time": time.time()})

    def _register_members(self) -> list[str]:
        """Every member that is not down, in the new router; those the run had paused, paused again."""
        client, registered = self.routing.raw_client, []
        for url in self.routing.members():
            try:
                client.add_worker(url)
                if self.intended.get(url) in PAUSED_STATES:
                    client.set_worker_state(url, self.intended[url])
                registered.append(url)
            except MilesDisaggError as exc:  # it may have gone down meanwhile: the monitor restores it later
                log.warning("registering %s with the restarted router: %s", url, exc)
        return registered

    # ------------------------------------------------------------------ the monitor's check

    def check(self) -> None:
        """The monitor's: restart a router whose process exited, or that does not answer ``/health`` and
        has answered nothing for :data:`STALL_BOUND_S`."""
        import httpx

        router = self.routing.router
        if router is None or self.stopping.is_set():
            return
        generation = self.generation
        if not self.process_alive():
            self.restart(generation, why=self.why_unreachable(0.0, RouterUnreachable("process gone")))
            return
        try:
            answered = httpx.get(f"{router.url}/health", timeout=HEALTH_TIMEOUT_S, trust_env=False).status_code == 200
        except httpx.HTTPError:
            answered = False
        now = self.clock()
        if answered:
            self.last_answered = now
        elif now - self.last_answered >= STALL_BOUND_S:
            self.restart(generation, why=f"it answered nothing for {now - self.last_answered:.0f}s (/health "
                                         f"unanswered within {HEALTH_TIMEOUT_S:g}s)")

    def metrics(self) -> dict[str, float]:
        return {"rollout/router_restarts": float(self.restarts), "rollout/router_call_retries": float(self.call_retries)}


class GuardedRouter:
    """The router client the run's parts use: each call through :meth:`RouterKeeper.call`."""

    def __init__(self, keeper: RouterKeeper):
        self.keeper = keeper

    @property
    def url(self) -> str:
        return self.keeper.routing.router.url

    def add_worker(self, worker_url: str) -> dict:
        return self.keeper.call(f"add_worker {worker_url}", lambda c: c.add_worker(worker_url))

    def remove_worker(self, worker_url: str) -> dict:
        self.keeper.intended.pop(worker_url, None)
        return self.keeper.call(f"remove_worker {worker_url}", lambda c: c.remove_worker(worker_url))

    def set_worker_state(self, worker_url: str, state: str, **kwargs: Any) -> dict:
        self.keeper.intended[worker_url] = state  # a restart in between restores it
        return self.keeper.call(f"set_worker_state {worker_url} {state}",
                                lambda c: c.set_worker_state(worker_url, state, **kwargs))

    def wait_worker_version(self, worker_url: str, version: int, timeout_s: float = 30.0) -> dict:
        return self.keeper.call(f"wait for {worker_url} at v{version}",
                                lambda c: c.wait_worker_version(worker_url, version, timeout_s=timeout_s))

    def list_workers(self) -> list[dict]:
        return self.keeper.call("list_workers", lambda c: c.list_workers())

    def worker(self, worker_url: str) -> dict:
        return self.keeper.call(f"worker {worker_url}", lambda c: c.worker(worker_url))

    def metrics(self) -> dict:
        return self.keeper.call("metrics", lambda c: c.metrics())
