"""The engine manager's monitor: a thread that checks every engine and recovers those that went down.

``--rollout-health-check-first-wait`` once, then each ``--rollout-health-check-interval``: engines
on a node Ray says is gone leave the router at once (:mod:`miles_disagg.fleet.replace` places them
again); every other engine must have a live process (a managed one, as its actor says) and answer
``/health`` within ``--rollout-health-check-timeout``, failing
``--rollout-health-check-failure-threshold`` times in a row at most. One that does not leaves the
router (:meth:`~miles_disagg.fleet.routing.EngineRouting.take_out`). Then, with
``--use-fault-tolerance``, a managed engine is restarted by its actor; an attached one is re-checked
against the job once it answers again; either is restored at the set's version
(:meth:`~miles_disagg.fleet.routing.EngineRouting.restore`). Without it, a managed engine whose
process failed is recorded ``lost`` and the next update fails the run. The number of serving
engines feeds the run's capacity policy (:mod:`miles_disagg.fleet.capacity`). Each interval also
checks the router (:meth:`~miles_disagg.fleet.router_keeper.RouterKeeper.check`): one that died or
stopped answering is started again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.engines.client import EngineClient
from miles_disagg.fleet.capacity import CapacityPolicy
from miles_disagg.fleet.replace import Replacements
from miles_disagg.fleet.routing import EngineRouting
from miles_disagg.fleet.slots import EngineSlots

log = logging.getLogger(__name__)


class EngineMonitor:
    """Health checks and recovery of the engines in ``slots`` (see the module docstring); stops once
    ``stopping`` is set."""

    def __init__(self, config: EngineManagerConfig, slots: EngineSlots, routing: EngineRouting,
                 replacements: Replacements, stopping: threading.Event):
        self.config, self.rollout = config, config.rollout
        self.slots, self.routing, self.replacements, self.stopping = slots, routing, replacements, stopping
        self.capacity_policy = CapacityPolicy(self.rollout.min_rollout_engines, self.rollout.min_rollout_engines_timeout)
        self._thread: threading.Thread | None = None
        self.on_moved: Callable[[int, dict | None], None] = lambda index, site: None
        """Called with an engine's index once its actor restarted it at a new address (site: None,
        it stays on its bundle): the engine manager records it (``placement.json``)."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="engine-monitor", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float = 60.0) -> None:
        """Until the thread ends (``stopping`` set first): a restart in progress finishes."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)

    def _watch(self) -> None:
        if self.stopping.wait(self.rollout.rollout_health_check_first_wait):
            return
        while not self.stopping.wait(self.rollout.rollout_health_check_interval):
            try:
                self.routing.keeper.check()  # a router that died or stopped answering is started again
            except Exception:  # the next interval tries again; control calls restart it too
                log.exception("checking the router")
            try:
                self.replacements.drop_lost_nodes()  # Ray says a node is gone: no health-check timeout to wait
            except Exception:  # the GCS did not answer this time: the checks below still run
                log.exception("asking Ray which nodes are alive")
            for index in self.slots.indices():
                if self.stopping.is_set():
                    return
                try:
                    self.check_engine(index)
                except Exception as exc:  # keep watching the others; record why
                    log.exception("engine %d: recovery failed", index)
                    self.slots.record({"engine": index, "event": "recovery_failed", "error": str(exc)})
            self.observe_capacity()

    # ------------------------------------------------------------------ capacity

    def observe_capacity(self) -> None:
        """Members that serve, of all members: an engine removed by ``engines remove`` counts as
        neither (with ``--force``, the last one leaves the run none: rollout waits for a join, at
        most ``--min-rollout-engines-timeout``)."""
        self.capacity_policy.observe(self.slots.serving(), len(self.slots.members()))

    def capacity(self) -> dict:
        """How many engines serve, and ``verdict``: the line that ends the run once fewer than
        ``--min-rollout-engines`` served for longer than its timeout (else None)."""
        self.observe_capacity()
        members = set(self.slots.members())
        return self.capacity_policy.report(self.slots.events, self.slots.down() & members,
                                           removed=len(self.slots) - len(members))

    # ------------------------------------------------------------------ one engine

    def alive(self, index: int) -> bool:
        """A managed engine: its process runs (as its actor says); an attached one: it answers ``/health``."""
        if self.slots.is_managed(index):  # an attached engine of a managed run has no actor
            return not self.slots.is_lost(index) and bool(self.process_alive(index))
        with EngineClient(self.slots.url(index), timeout_s=3) as client:
            return client.healthy()

    def is_live(self, index: int) -> bool:
        """False (and the engine taken out of the router) when it is down, removed, or just died."""
        if self.slots.is_down(index) or self.slots.is_removed(index):
            return False
        if self.alive(index):
            return True
        self.routing.take_out(index)
        return False

    def check_engine(self, index: int) -> None:
        """One health check of engine ``index``; a down engine is recovered when it can be."""
        slots = self.slots
        if slots.is_removed(index):
            return  # left the run (engines remove)
        managed = slots.is_managed(index)
        if slots.is_lost(index) or self.replacements.busy(index):
            return  # gone with its actor: being placed again (fleet/replace.py)
        if not slots.is_down(index):
            with slots.lock:
                if self._passes_health_check(index):
                    return
                self.routing.take_out(index)
            if not managed:
                return  # an attached engine: restored once it answers again (a later check)
        if slots.broadcast_group or slots.is_lost(index):
            return  # a broadcast group cannot take a new member; a lost actor is placed again elsewhere
        if managed and not self.rollout.use_fault_tolerance:
            if self.process_alive(index) is not None:  # its process failed (not its node: that is placed again)
                self._record_lost(index)
            return
        if managed and not self._restarted(index):
            return
        if not managed and not self._answers_and_matches(index):
            return
        self.routing.restore(index)

    def _restarted(self, index: int) -> bool:
        """Its actor restarts the engine (a new URL); False when the actor cannot say or is gone."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        try:
            self.slots.set_url(index, ray.get(self.slots.actor(index).restart.remote()))
        except ActorUnavailableError:  # its node may be going: the next check (or Ray's verdict) decides
            return False
        except RayActorError as exc:  # gone with its node: placed again, not restarted
            self.replacements.engine_gone(index, "actor_lost", why=f"its actor is gone: {str(exc).splitlines()[0]}")
            return False
        self.on_moved(index, None)
        return True

    def process_alive(self, index: int) -> bool | None:
        """Whether managed engine ``index``'s process runs, as its actor says; None when the actor
        does not answer (unreachable: its node may be going) or is gone (then it is placed again)."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        try:
            return bool(ray.get(self.slots.actor(index).alive.remote(), timeout=self.rollout.rollout_health_check_timeout))
        except (ActorUnavailableError, GetTimeoutError):
            return None
        except RayActorError as exc:
            self.replacements.engine_gone(index, "actor_lost", why=f"its actor is gone: {str(exc).splitlines()[0]}")
            return None

    def _passes_health_check(self, index: int) -> bool:
        """A managed engine's process must be alive; every engine must answer ``/health`` within
        ``--rollout-health-check-timeout``, failing ``--rollout-health-check-failure-threshold``
        times in a row at most."""
        if self.slots.has_actors and not self.alive(index):
            return False
        timeout_s = self.rollout.rollout_health_check_timeout
        with EngineClient(self.slots.url(index), timeout_s=timeout_s) as client:
            ok = client.healthy(timeout_s=timeout_s)
        return self.slots.count_health_check(index, ok) < self.rollout.rollout_health_check_failure_threshold

    def _record_lost(self, index: int) -> None:
        if any(e["event"] == "lost" and e["engine"] == index for e in self.slots.events):
            return
        why = "its process exited" if self.slots.has_actors and not self.alive(index) else "it failed its health checks"
        log.error("engine %d went down (%s); --use-fault-tolerance is off: not restarting it", index, why)
        self.slots.record({"engine": index, "event": "lost", "url": self.slots.url(index), "why": why,
                           "time": time.time()})

    def _answers_and_matches(self, index: int) -> bool:
        """An attached engine that answers again is re-checked against the job (no key sent before
        it passed: :mod:`miles_disagg.fleet.vetting`) before it is restored."""
        from miles_disagg.fleet.vetting import vet

        url = self.slots.url(index)
        vetting = vet(self.config, url, answer_timeout_s=0)
        if not vetting.answered:
            return False
        if vetting.refusal is not None:
            if not any(e["event"] == "mismatch" and e["engine"] == index for e in self.slots.events[-5:]):
                self.slots.record({"engine": index, "event": "mismatch", "url": url,
                                   "problems": list(vetting.problems) or [vetting.refusal], "time": time.time()})
            return False
        self.slots.set_server_ids(index, vetting.server_ids)  # it may be another process than before
        return True
