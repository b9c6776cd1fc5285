"""The run's router and which engines are in it.

:class:`EngineRouting` starts the router (the job's version-aware router, or sglang-router) on the
driver's node, and moves engines out of it and back in, keeping the slots' ``down`` flags in
step: an engine that goes down leaves the router at once (:meth:`EngineRouting.take_out`); one
that was restarted or placed again is brought to the set's version, must report that version
itself, and only then is registered again (:meth:`EngineRouting.restore`). Every call to the router
goes through ``client`` (:class:`~miles_disagg.fleet.router_keeper.GuardedRouter`): retried while the
router is alive, the router restarted at the same address when it stays unreachable.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.fleet.router_keeper import CALL_TIMEOUT_S, GuardedRouter, RouterKeeper
from miles_disagg.fleet.slots import EngineSlots

log = logging.getLogger(__name__)


def verify_served_version(url: str, index: int, version: int) -> None:
    """The engine itself must report ``version`` before the router may use it (after a restart's
    or a replacement's catch-up): ``EngineUnrecoverable`` otherwise, and it stays out."""
    from miles_disagg.engines.client import EngineClient
    from miles_disagg.types import EngineUnrecoverable

    with EngineClient(url, timeout_s=30) as client:
        served = client.weight_version()
    if str(served) != str(version):
        raise EngineUnrecoverable(f"engine {index} ({url}) reports version {served!r} after its catch-up to version "
                                  f"{version}; it stays out of the router")


class EngineRouting:
    """The router (``router``, its ``client`` once :meth:`start` ran) and the engines' places in it.

    ``updater(indices, registered=False)``: a disk-delta updater over those engines that does not
    tell the router about them (the engine manager's); ``stopping``: set when the run stops."""

    def __init__(self, config: EngineManagerConfig, slots: EngineSlots, updater: Callable[..., Any],
                 stopping: threading.Event | None = None):
        self.config = config
        self.slots = slots
        self.updater = updater
        self.router = None
        self.raw_client = None
        """The client of the router process now running (``client`` goes through the keeper)."""
        self.keeper = RouterKeeper(self, slots.record, stopping or threading.Event())
        self.client = GuardedRouter(self.keeper)
        self._starts = 0

    def start(self, workers: list[str], port: int | None = None) -> None:
        """Start the router with ``workers`` (sglang-router takes them at start; ours gets them later),
        on ``port`` (None: the plan's, else a free one)."""
        from miles_disagg.fleet.plan import ROUTER_RETRY_AFTER_S, router_plan
        from miles_disagg.net.netbind import bind_host, resolve_host

        self._starts += 1
        log_path = Path(self.config.run_dir) / "logs" / ("router.log" if self._starts == 1 else
                                                         f"router-{self._starts}.log")
        plan = router_plan(self.config)
        host = resolve_host(bind_host(spans_nodes=self.config.spans_nodes))  # the manager runs on the driver's node
        port = port or plan.port
        if plan.kind == "sglang":
            from miles_disagg.router.sglang_router import SglangRouterClient, launch_sglang_router

            self.router = launch_sglang_router(log_path=log_path, workers=workers, port=port, policy=plan.policy,
                                               host=host)
            self.raw_client = SglangRouterClient(self.router.url)
            return
        from miles_disagg.router.launch import launch_router

        self.router = launch_router(log_path=log_path, port=port, host=host,
                                    health_check_interval_s=plan.health_check_interval_s,
                                    retry_after_s=ROUTER_RETRY_AFTER_S, extra_args=plan.extra_args)
        self.raw_client = self.router.client(timeout_s=CALL_TIMEOUT_S)

    def relaunch(self) -> None:
        """The keeper's restart: kill the router process (a stopped one too) and start one at its address."""
        from urllib.parse import urlsplit

        old, old_client = self.router, self.raw_client
        port = urlsplit(old.url).port
        old.proc.kill()
        old.proc.wait(timeout=30)
        self.start(self.members() if self.router_kind() == "sglang" else [], port=port)
        if hasattr(old_client, "close"):
            old_client.close()  # once no caller can pick it up any more

    def router_kind(self) -> str:
        from miles_disagg.fleet.plan import router_plan

        return router_plan(self.config).kind

    def members(self) -> list[str]:
        """The URLs the router should hold: every member engine that is not down."""
        return [self.slots.url(i) for i in self.slots.members() if not self.slots.is_down(i)]

    def take_out(self, index: int) -> None:
        """Engine ``index`` is down: out of the router now (no-op when it is out already: the
        monitor and an update may both find it gone)."""
        if not self.slots.mark_down(index):
            return
        url = self.slots.url(index)
        try:
            self.client.remove_worker(url)
        except Exception as exc:  # the router may already have dropped it
            log.info("remove_worker %s: %s", url, exc)
        self.slots.record({"engine": index, "event": "down", "url": url, "time": time.time()})

    def restore(self, index: int) -> None:
        """Bring a (re)started engine to the set's version, then let the router use it."""
        slots = self.slots
        with slots.lock:
            if slots.is_removed(index):
                return  # removed (engines remove) while it was down: it stays out
            version, url = slots.version, slots.url(index)
            if version > 0:
                updater = self.updater([index], registered=False)  # added to the router only below
                try:
                    updater.update(version)
                finally:
                    updater.close()
            verify_served_version(url, index, version)
            self.client.add_worker(url)
            slots.mark_up(index)
            slots.record({"engine": index, "event": "restored", "url": url, "version": version, "time": time.time()})

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        if self.raw_client is not None and hasattr(self.raw_client, "close"):
            self.raw_client.close()
