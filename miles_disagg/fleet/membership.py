"""Engines join and leave a running job (``miles-disagg engines add|remove|list``).

Disk-delta makes membership free: any engine can be brought to the run's current version from
the version store (anchor plus deltas) at any time, so the engine set need not be fixed at start.
:class:`Membership` lives inside the engine manager (one per run) and changes its engine set
(:class:`~miles_disagg.fleet.slots.EngineSlots`):

* **join** (:meth:`Membership.add_attached`, :meth:`Membership.add_managed`): every address is
  checked first, as an engine attached at start is (it answers, it serves this job's model with
  this job's tp size, dtype and context, it pulls from this job's store); one that fails changes
  nothing. Each is then brought to the current version *outside* the engine set's lock (the other
  engines keep generating and updating meanwhile), then, under the lock, to any version activated
  during that catch-up, and only then added to the router and to the set later updates cover.
  So an engine is never routed to before it verified the version the others serve.
* **leave** (:meth:`Membership.remove`): the engine leaves the updated set and the router stops
  sending it new requests (``paused``); once its in-flight requests finished (the router counts
  them) or ``drain_timeout_s`` passed, it leaves the router. A managed engine is then stopped;
  an attached one keeps running, detached. The last live engine is kept unless ``force``.

Every change is appended to ``membership.jsonl`` in the run directory and ``placement.json``'s
``engines`` are rewritten to the current members (:mod:`miles_disagg.fleet.members`). One change
at a time (a lock of its own); the engine set's lock is held only while the set itself changes,
never while an engine catches up or drains.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.engines.client import EngineClient
from miles_disagg.fleet.members import (FreedBundles, MemberInfo, MemberRecords, MembershipRefused, UnknownEngine,
                                        join_failed, normalize)
from miles_disagg.fleet.routing import EngineRouting
from miles_disagg.fleet.slots import EngineSlots
from miles_disagg.types import InvalidInput, MilesDisaggError

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 10.0
DRAIN_POLL_S = 0.1
DEFAULT_DRAIN_TIMEOUT_S = 120.0


class Membership:
    """The engine set's membership changes and records (see the module docstring). ``routing``'s
    router client is used once the run started; ``placement``: the run's (None: it launched nothing)."""

    def __init__(self, config: EngineManagerConfig, slots: EngineSlots, routing: EngineRouting, placement: Any = None):
        self.config = config
        self.slots = slots
        self.routing = routing
        self.records = MemberRecords(config.run_dir, slots, placement)
        self.placement = placement
        self.freed: list[FreedBundles] = []
        """Bundles of the run's placement that removed managed engines gave back (``--managed`` adds use them first)."""
        self._changing = threading.Lock()

    def record_start(self) -> None:
        """The engines the run started with: ``membership.jsonl``'s first lines and ``placement.json``."""
        self.records.record_start()
        self.records.write_placement()

    def engine_moved(self, index: int, site: dict | None) -> None:
        """Engine ``index`` serves at a new address: restarted by its actor (``site`` None: same
        bundle), or placed again after its node or actor was lost (``site``: where now). Recorded in
        ``membership.jsonl`` (``moved``) and ``placement.json`` (once the run started recording)."""
        if site is not None:
            self.records.info[index] = MemberInfo("managed", site.get("node_ip"), site.get("node_id"),
                                                  [str(g) for g in site.get("gpu_ids") or []],
                                                  joined=self.records.info_of(index).joined)
        if self.records.started:
            why = "placed again (its node or actor was lost)" if site is not None else "restarted by its actor"
            self.records.record("moved", index, why=why)
            self.records.write_placement()

    # ------------------------------------------------------------------ join

    def add_attached(self, urls: list[str]) -> list[dict]:
        """Check every address, then bring each to the current version and route to it."""
        with self._changing:
            self._refuse_unless_disk_delta()
            urls = [normalize(u) for u in urls]
            server_ids = self._check_new(urls)
            joined: list[dict] = []
            for url in urls:
                try:
                    joined.append(self._join(url, MemberInfo("attached", urlsplit(url).hostname), why="engines add",
                                             server_ids=server_ids[url]))
                except MilesDisaggError as exc:
                    raise join_failed(url, exc, joined) from exc
            return joined

    def add_managed(self, count: int) -> list[dict]:
        """``count`` more managed engines on GPUs the cluster has free: placed, caught up, routed."""
        from miles_disagg.fleet.managed_join import start_managed_engines, stop_started

        if count < 1:
            raise InvalidInput(f"--managed must be at least 1, got {count}")
        with self._changing:
            self._refuse_unless_disk_delta()
            started = start_managed_engines(self.config, count, first_index=len(self.slots), freed=self.freed)
            joined: list[dict] = []
            for position, (actor, url, info) in enumerate(started):
                try:
                    joined.append(self._join(url, info, why=f"engines add --managed {count}", actor=actor))
                except BaseException as exc:
                    for left, _url, left_info in started[position:]:  # started, never routed to: stopped
                        stop_started(left, left_info.placement_group)
                        self._give_back(left_info.run_bundles)
                    if isinstance(exc, MilesDisaggError):
                        raise join_failed(url, exc, joined) from exc
                    raise
            return joined

    def _refuse_unless_disk_delta(self) -> None:
        if self.config.weights.update_weight_transfer_mode != "disk-delta" or self.slots.broadcast_group:
            raise MembershipRefused("this run updates weights by broadcast: an NCCL group cannot change "
                                    "members (use --update-weight-transfer-mode disk-delta)")
        if self.config.cluster.colocate:
            raise MembershipRefused("this run is colocated (engines share the trainer's GPUs): its engine set "
                                    "is fixed")

    def _check_new(self, urls: list[str]) -> dict[str, frozenset[str]]:
        """Every address answers, matches the job and is a server of its own (not a member, nor
        another address named, under another address); ``InvalidInput`` naming each that is not
        (nothing is changed, and no key was sent to any of them). Returns each one's server ids."""
        from miles_disagg.fleet.vetting import vet

        problems, passed = [], {}
        current = {self.slots.url(i): i for i in self.slots.members()}
        known = self._member_ids(urls)
        for url in urls:
            if url in current or urls.count(url) > 1:
                problems.append(f"{url} is already an engine of this run (engine {current[url]})" if url in current
                                else f"{url} is named twice")
                continue
            vetting = vet(self.config, url, answer_timeout_s=ANSWER_TIMEOUT_S)
            if vetting.refusal is not None:
                problems.append(f"{url} {vetting.refusal}")
                continue
            member = next((i for i, ids in known.items() if ids & vetting.server_ids), None)
            named = next((other for other, ids in passed.items() if ids & vetting.server_ids), None)
            if member is not None:
                problems.append(f"{url} is already an engine of this run: engine {member} "
                                f"({self.slots.url(member)}) answers there too (one server, two addresses)")
            elif named is not None:
                problems.append(f"{url} and {named} are one server under two addresses; name it once")
            else:
                passed[url] = vetting.server_ids
        if problems:
            raise InvalidInput("nothing was added: " + "; ".join(problems))
        return passed

    def _member_ids(self, urls: list[str]) -> dict[int, frozenset[str]]:
        """Each member's server ids; asked again (no key: ``/health``) where not known yet or where
        the member listens on the port of one of ``urls`` (an alias has its port; the member may
        have restarted since it was asked)."""
        from concurrent.futures import ThreadPoolExecutor

        from miles_disagg.fleet.vetting import NotAnswering, health_identity

        ports = {urlsplit(u).port for u in urls}
        ask = [i for i in self.slots.members()
               if not self.slots.server_ids(i) or urlsplit(self.slots.url(i)).port in ports]

        def asked(index: int) -> None:
            try:
                self.slots.set_server_ids(index, health_identity(self.slots.url(index), 0))
            except NotAnswering:
                pass  # down: what it said before stands (an alias of it cannot answer either)

        if ask:
            with ThreadPoolExecutor(min(16, len(ask))) as pool:
                list(pool.map(asked, ask))
        return {i: self.slots.server_ids(i) for i in self.slots.members()}

    def _join(self, url: str, info: MemberInfo, *, why: str, actor: Any = None,
              server_ids: frozenset[str] = frozenset()) -> dict:
        """Catch up outside the set's lock, then (under it) to any newer version, then register and route."""
        from miles_disagg.fleet.attach import engine_local_dir
        from miles_disagg.fleet.plan import local_checkpoint_root

        slots, router = self.slots, self.routing.client
        local_dir = engine_local_dir(url, local_checkpoint_root(self.config) / f"engine-{len(slots)}")
        started = time.monotonic()
        reached = self.catch_up(url, local_dir, slots.version)
        with slots.lock:
            while reached != slots.version:  # a version was activated while this one caught up
                reached = self.catch_up(url, local_dir, slots.version)
            index = slots.add(url, local_dir, actor=actor, server_ids=server_ids)  # later updates cover it
            self.records.info[index] = info
            try:
                router.add_worker(url)
                router.wait_worker_version(url, reached, timeout_s=60)
            except BaseException:
                slots.mark_removed(index)  # never a member: later updates and the monitor leave it out
                _quietly(router.remove_worker, url)
                raise
        catch_up_s = time.monotonic() - started
        slots.record({"engine": index, "event": "joined", "url": url, "version": reached, "time": time.time()})
        self.records.record("add", index, why=why, catch_up_s=round(catch_up_s, 3))
        self.records.write_placement()
        return {"url": url, "engine": index, "version": reached, "kind": info.kind, "catch_up_s": catch_up_s}

    def catch_up(self, url: str, local_dir: str, version: int) -> int:
        """Bring the engine at ``url`` to ``version`` (not routed to: the router is not told);
        returns ``version``. An engine already at the base skips the base."""
        from miles_disagg.engines.updater import DiskDeltaUpdater

        if version == 0:
            with EngineClient(url, timeout_s=10) as client:
                if client.weight_version() == "0":
                    return 0
        updater = DiskDeltaUpdater([url], store_dir=self.config.weights.update_weight_disk_dir, local_dirs=[local_dir],
                                   pause_mode=self.config.rollout.pause_generation_mode, set_state=None)
        try:
            updater.update(version)
        finally:
            updater.close()
        return version

    # ------------------------------------------------------------------ leave

    def remove(self, urls: list[str], *, force: bool = False,
               drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> list[dict]:
        """Drain, then detach (attached) or stop (managed) each engine at ``urls``."""
        with self._changing:
            self._refuse_unless_disk_delta()
            indices = self._indices_of([normalize(u) for u in urls])
            self._refuse_last(indices, force)
            return [self._leave(index, drain_timeout_s) for index in indices]

    def _indices_of(self, urls: list[str]) -> list[int]:
        by_url = {self.slots.url(i): i for i in self.slots.members()}
        unknown = [u for u in urls if u not in by_url]
        if unknown:
            raise UnknownEngine(f"not an engine of this run: {', '.join(unknown)} (its engines: "
                                f"{', '.join(by_url) or 'none'}); nothing was removed")
        return list(dict.fromkeys(by_url[u] for u in urls))

    def _refuse_last(self, indices: list[int], force: bool) -> None:
        left = [i for i in self.slots.members() if i not in indices and not self.slots.is_down(i)]
        if not left and not force:
            raise MembershipRefused(f"removing {len(indices)} engine(s) would leave this run no live engine to "
                                    "generate with (rollout would wait until one joins); pass --force to remove "
                                    "them anyway; nothing was removed")

    def _leave(self, index: int, drain_timeout_s: float) -> dict:
        slots, router = self.slots, self.routing.client
        url = slots.url(index)
        with slots.lock:  # no update in flight: it leaves the updated set, then new requests stop
            slots.mark_removed(index)
            version = slots.version
            try:
                router.set_worker_state(url, "paused")
            except MilesDisaggError as exc:  # the router dropped it already (down)
                log.info("pause %s in the router: %s", url, exc)
        started = time.monotonic()
        drained = self._drain(url, drain_timeout_s)
        try:
            router.remove_worker(url)
        except MilesDisaggError as exc:
            log.info("remove_worker %s: %s", url, exc)
        kind = self._stop_if_managed(index)
        why = "drained" if drained else f"still had requests in flight after {drain_timeout_s:g}s"
        slots.record({"engine": index, "event": "removed", "url": url, "time": time.time()})
        self.records.record("remove", index, why=f"engines remove ({why})", version=version,
                            drain_s=round(time.monotonic() - started, 3))
        self.records.write_placement()
        return {"url": url, "engine": index, "kind": kind, "drained": drained,
                "drain_s": time.monotonic() - started}

    def _drain(self, url: str, timeout_s: float) -> bool:
        """Until the router counts no request in flight on ``url``; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.routing.client.worker(url)["outstanding"] == 0:
                    return True
            except MilesDisaggError:
                return True  # not in the router: nothing in flight through it
            if time.monotonic() > deadline:
                return False
            time.sleep(DRAIN_POLL_S)

    def _stop_if_managed(self, index: int) -> str:
        import ray

        actor = self.slots.actor(index)
        if actor is None:
            return "attached"
        try:
            ray.get(actor.stop.remote(), timeout=60)
        except Exception as exc:  # its process may be gone already
            log.info("stopping engine %d: %s", index, exc)
        ray.kill(actor)
        self.slots.set_actor(index, None)
        info = self.records.info_of(index)
        if info.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(info.placement_group)
        else:  # on bundles of the run's placement: they stay reserved for the run, free for a --managed add
            self._give_back(info.run_bundles if info.run_bundles is not None else self._run_bundles_of(index))
        return "managed"

    def _run_bundles_of(self, index: int) -> list[int] | None:
        """The run's placement positions of engine ``index`` when the run started it (else None)."""
        placement = self.placement
        if placement is None or index >= len(placement.layout.engines):
            return None
        return list(placement.layout.engines[index])

    def _give_back(self, positions: list[int] | None) -> None:
        if positions is None or self.placement is None:
            return
        site = self.placement.site(positions[0])
        self.freed.append(FreedBundles(positions, self.placement.strategy(positions[0]),
                                       {"node_id": site["node_id"], "node_ip": site["node_ip"],
                                        "gpu_ids": [self.placement.site(p)["gpu_id"] for p in positions]}))

    # ------------------------------------------------------------------ views

    def list(self) -> list[dict]:
        """Every current engine: url, kind, version it serves, state in the run, node."""
        try:
            routed = {w["url"]: w for w in self.routing.client.list_workers()}
        except MilesDisaggError:
            routed = {}
        rows = []
        for index in self.slots.members():
            url = self.slots.url(index)
            info = self.records.info_of(index)
            rows.append({"engine": index, "url": url, "kind": info.kind, "version": _reported_version(url),
                         "state": self._state(index, routed), "node": info.node_ip,
                         "node_id": info.node_id, "outstanding": routed.get(url, {}).get("outstanding")})
        return rows

    def _state(self, index: int, routed: dict[str, dict]) -> str:
        if self.slots.is_lost(index):
            return "lost"
        if self.slots.is_down(index):
            return "down"
        worker = routed.get(self.slots.url(index))
        return worker["state"] if worker else "not routed"


def _quietly(call, *args) -> None:
    try:
        call(*args)
    except MilesDisaggError as exc:
        log.info("%s%s: %s", getattr(call, "__name__", call), args, exc)


def _reported_version(url: str) -> str | None:
    try:
        with EngineClient(url, timeout_s=5) as client:
            return client.weight_version()
    except MilesDisaggError:
        return None
