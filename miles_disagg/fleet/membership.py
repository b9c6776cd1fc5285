"""Engines join and leave a running job (``miles-disagg engines add|remove|list``).

Disk-delta makes membership free: any engine can be brought to the run's current version from
the version store (anchor plus deltas) at any time, so the engine set need not be fixed at start.
:class:`Membership` lives inside the engine manager (one per run) and changes its engine set:

* **join** (:meth:`Membership.add_attached`, :meth:`Membership.add_managed`): every address is
  checked first, as an engine attached at start is (it answers, it serves this job's model with
  this job's tp size, dtype and context, it pulls from this job's store); one that fails changes
  nothing. Each is then brought to the current version *outside* the manager's lock (the other
  engines keep generating and updating meanwhile), then, under the lock, to any version activated
  during that catch-up, and only then added to the router and to the set later updates cover.
  So an engine is never routed to before it verified the version the others serve.
* **leave** (:meth:`Membership.remove`): the engine leaves the updated set and the router stops
  sending it new requests (``paused``); once its in-flight requests finished (the router counts
  them) or ``drain_timeout_s`` passed, it leaves the router. A managed engine is then stopped;
  an attached one keeps running, detached. The last live engine is kept unless ``force``.

Every change is appended to ``membership.jsonl`` in the run directory (time, action, url,
version, node, why) and ``placement.json``'s ``engines`` are rewritten to the current members.
One change at a time (a lock of its own); the manager's lock is held only while the engine set
itself changes, never while an engine catches up or drains.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from miles_disagg.engines.client import EngineClient
from miles_disagg.types import ConfigError, InvalidInput, MilesDisaggError, ReplaceReplica

if TYPE_CHECKING:
    from miles_disagg.fleet.manager import EngineManager

log = logging.getLogger(__name__)

MEMBERSHIP_FILENAME = "membership.jsonl"
PLACEMENT_FILENAME = "placement.json"  # the run's (miles_disagg.loop.cluster writes it at start)
ANSWER_TIMEOUT_S = 10.0
DRAIN_POLL_S = 0.1
DEFAULT_DRAIN_TIMEOUT_S = 120.0


class UnknownEngine(InvalidInput):
    """``engines remove`` named an address that is not a member of the run."""


class JoinFailed(ReplaceReplica):
    """An engine that passed the attach checks failed to catch up or register; it is not routed to."""


def join_failed(url: str, cause: BaseException, joined: list[dict]) -> JoinFailed:
    before = f"; joined before it: {', '.join(j['url'] for j in joined)}" if joined else ""
    return JoinFailed(f"{url} did not join: {type(cause).__name__}: {cause}{before}")


class MembershipRefused(InvalidInput):
    """A change this run cannot make (broadcast or colocated weights, the last engine, no free GPUs)."""


@dataclass
class MemberInfo:
    """What the run knows of one engine beyond its URL (index: its place in the manager's lists)."""

    kind: str  # "managed" or "attached"
    node_ip: str | None = None
    node_id: str | None = None
    gpu_ids: list[str] = field(default_factory=list)
    joined: float = field(default_factory=time.time)
    placement_group: Any = None  # a managed engine added mid-run: its own bundles


def normalize(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``."""
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


class Membership:
    """The engine manager's membership changes and records (see the module docstring)."""

    def __init__(self, manager: "EngineManager"):
        self.manager = manager
        self.removed: set[int] = set()
        self.info: dict[int, MemberInfo] = {}
        self._changing = threading.Lock()

    # ------------------------------------------------------------------ state

    def is_removed(self, index: int) -> bool:
        return index in self.removed

    def members(self) -> list[int]:
        return [i for i in range(len(self.manager.engine_urls)) if i not in self.removed]

    def record_start(self) -> None:
        """The engines the run started with: the stream's first lines."""
        for index in self.members():
            self.info.setdefault(index, self._initial_info(index))
            self._record("start", index, why="engine the run started with")

    def _initial_info(self, index: int) -> MemberInfo:
        manager = self.manager
        placement = manager.placement
        if manager._actors and placement is not None and index < len(placement.layout.engines):
            positions = placement.layout.engines[index]
            site = placement.site(positions[0])
            return MemberInfo("managed", site["node_ip"], site["node_id"],
                              [placement.site(p)["gpu_id"] for p in positions])
        return MemberInfo("attached", urlsplit(manager.engine_urls[index]).hostname)

    # ------------------------------------------------------------------ join

    def add_attached(self, urls: list[str]) -> list[dict]:
        """Check every address, then bring each to the current version and route to it."""
        with self._changing:
            self._refuse_unless_disk_delta()
            urls = [normalize(u) for u in urls]
            self._check_new(urls)
            joined: list[dict] = []
            for url in urls:
                try:
                    joined.append(self._join(url, MemberInfo("attached", urlsplit(url).hostname), why="engines add"))
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
            started = start_managed_engines(self.manager, count, first_index=len(self.manager.engine_urls))
            joined: list[dict] = []
            for position, (actor, url, info) in enumerate(started):
                try:
                    joined.append(self._join(url, info, why=f"engines add --managed {count}", actor=actor))
                except BaseException as exc:
                    for left, _url, left_info in started[position:]:  # started, never routed to: stopped
                        stop_started(left, left_info.placement_group)
                    if isinstance(exc, MilesDisaggError):
                        raise join_failed(url, exc, joined) from exc
                    raise
            return joined

    def _refuse_unless_disk_delta(self) -> None:
        manager = self.manager
        if manager.weights.update_weight_transfer_mode != "disk-delta" or manager._broadcast is not None:
            raise MembershipRefused("this run updates weights by broadcast: an NCCL group cannot change "
                                    "members (use --update-weight-transfer-mode disk-delta)")
        if manager.cluster.colocate:
            raise MembershipRefused("this run is colocated (engines share the trainer's GPUs): its engine set "
                                    "is fixed")

    def _check_new(self, urls: list[str]) -> None:
        """Every address answers and matches the job; ``InvalidInput`` naming each that does not
        (nothing is changed)."""
        from miles_disagg.fleet.manager import _wait_answering

        problems = []
        current = {self.manager.engine_urls[i] for i in self.members()}
        for url in urls:
            if url in current or urls.count(url) > 1:
                problems.append(f"{url} is already an engine of this run" if url in current else
                                f"{url} is named twice")
                continue
            try:
                _wait_answering(url, ANSWER_TIMEOUT_S)
            except ConfigError:
                problems.append(f"{url} does not answer /health (engine unreachable)")
                continue
            try:
                mismatches = self.manager._mismatches(url)
            except MilesDisaggError as exc:
                mismatches = [f"cannot read its server and model info ({exc})"]
            if mismatches:
                problems.append(f"{url} does not match this job: {'; '.join(mismatches)}")
        if problems:
            raise InvalidInput("nothing was added: " + "; ".join(problems))

    def _join(self, url: str, info: MemberInfo, *, why: str, actor: Any = None) -> dict:
        """Catch up outside the manager's lock, then (under it) to any newer version, then route."""
        from miles_disagg.fleet.plan import local_checkpoint_root

        manager = self.manager
        index = len(manager.engine_urls)
        local_dir = manager._local_dir(url, local_checkpoint_root(manager.config) / f"engine-{index}")
        started = time.monotonic()
        reached = self.catch_up(url, local_dir, manager._version)
        with manager._lock:
            while reached != manager._version:  # a version was activated while this one caught up
                reached = self.catch_up(url, local_dir, manager._version)
            index = self._register(url, local_dir, info, actor)
            try:
                manager.router_client.add_worker(url)
                manager.router_client.wait_worker_version(url, reached, timeout_s=60)
            except BaseException:
                self.removed.add(index)  # never a member: later updates and the monitor leave it out
                _quietly(manager.router_client.remove_worker, url)
                raise
        catch_up_s = time.monotonic() - started
        manager.events.append({"engine": index, "event": "joined", "url": url, "version": reached,
                               "time": time.time()})
        self._record("add", index, why=why, catch_up_s=round(catch_up_s, 3))
        self.write_placement()
        return {"url": url, "engine": index, "version": reached, "kind": info.kind, "catch_up_s": catch_up_s}

    def catch_up(self, url: str, local_dir: str, version: int) -> int:
        """Bring the engine at ``url`` to ``version`` (not routed to: the router is not told);
        returns ``version``. An engine already at the base skips the base."""
        from miles_disagg.engines.updater import DiskDeltaUpdater

        if version == 0:
            with EngineClient(url, timeout_s=10) as client:
                if client.weight_version() == "0":
                    return 0
        manager = self.manager
        updater = DiskDeltaUpdater([url], store_dir=manager.weights.update_weight_disk_dir, local_dirs=[local_dir],
                                   pause_mode=manager.rollout.pause_generation_mode, set_state=None)
        try:
            updater.update(version)
        finally:
            updater.close()
        return version

    def _register(self, url: str, local_dir: str, info: MemberInfo, actor: Any) -> int:
        """Into the manager's lists (the caller holds its lock): later updates cover it."""
        manager = self.manager
        index = len(manager.engine_urls)
        if actor is not None or manager._actors:
            while len(manager._actors) < index:  # an attached run's first managed engine
                manager._actors.append(None)
            manager._actors.append(actor)
        manager.engine_urls.append(url)
        manager.local_dirs.append(local_dir)
        self.info[index] = info
        return index

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
        by_url = {self.manager.engine_urls[i]: i for i in self.members()}
        unknown = [u for u in urls if u not in by_url]
        if unknown:
            raise UnknownEngine(f"not an engine of this run: {', '.join(unknown)} (its engines: "
                                f"{', '.join(by_url) or 'none'}); nothing was removed")
        return list(dict.fromkeys(by_url[u] for u in urls))

    def _refuse_last(self, indices: list[int], force: bool) -> None:
        left = [i for i in self.members() if i not in indices and i not in self.manager._down]
        if not left and not force:
            raise MembershipRefused(f"removing {len(indices)} engine(s) would leave this run no live engine to "
                                    "generate with (rollout would wait until one joins); pass --force to remove "
                                    "them anyway; nothing was removed")

    def _leave(self, index: int, drain_timeout_s: float) -> dict:
        manager = self.manager
        url = manager.engine_urls[index]
        with manager._lock:  # no update in flight: it leaves the updated set, then new requests stop
            self.removed.add(index)
            version = manager._version
            try:
                manager.router_client.set_worker_state(url, "paused")
            except MilesDisaggError as exc:  # the router dropped it already (down)
                log.info("pause %s in the router: %s", url, exc)
        started = time.monotonic()
        drained = self._drain(url, drain_timeout_s)
        try:
            manager.router_client.remove_worker(url)
        except MilesDisaggError as exc:
            log.info("remove_worker %s: %s", url, exc)
        kind = self._stop_if_managed(index)
        why = "drained" if drained else f"still had requests in flight after {drain_timeout_s:g}s"
        manager.events.append({"engine": index, "event": "removed", "url": url, "time": time.time()})
        self._record("remove", index, why=f"engines remove ({why})", version=version,
                     drain_s=round(time.monotonic() - started, 3))
        self.write_placement()
        return {"url": url, "engine": index, "kind": kind, "drained": drained,
                "drain_s": time.monotonic() - started}

    def _drain(self, url: str, timeout_s: float) -> bool:
        """Until the router counts no request in flight on ``url``; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.manager.router_client.worker(url)["outstanding"] == 0:
                    return True
            except MilesDisaggError:
                return True  # not in the router: nothing in flight through it
            if time.monotonic() > deadline:
                return False
            time.sleep(DRAIN_POLL_S)

    def _stop_if_managed(self, index: int) -> str:
        import ray

        manager = self.manager
        actor = manager._actors[index] if index < len(manager._actors) else None
        if actor is None:
            return "attached"
        try:
            ray.get(actor.stop.remote(), timeout=60)
        except Exception as exc:  # its process may be gone already
            log.info("stopping engine %d: %s", index, exc)
        ray.kill(actor)
        manager._actors[index] = None
        group = self.info.get(index, MemberInfo("managed")).placement_group
        if group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(group)
        return "managed"

    # ------------------------------------------------------------------ views and records

    def list(self) -> list[dict]:
        """Every current engine: url, kind, version it serves, state in the run, node."""
        manager = self.manager
        try:
            routed = {w["url"]: w for w in manager.router_client.list_workers()}
        except MilesDisaggError:
            routed = {}
        rows = []
        for index in self.members():
            url = manager.engine_urls[index]
            info = self.info.get(index) or self._initial_info(index)
            rows.append({"engine": index, "url": url, "kind": info.kind, "version": _reported_version(url),
                         "state": _state(index, url, manager, routed), "node": info.node_ip,
                         "node_id": info.node_id, "outstanding": routed.get(url, {}).get("outstanding")})
        return rows

    def _record(self, action: str, index: int, *, why: str, version: int | None = None, **extra: Any) -> None:
        info = self.info.get(index) or self._initial_info(index)
        line = {"time": time.time(), "action": action, "url": self.manager.engine_urls[index], "engine": index,
                "kind": info.kind, "version": self.manager._version if version is None else version,
                "node": info.node_ip, "node_id": info.node_id, "why": why, **extra}
        path = Path(self.manager.run_dir) / MEMBERSHIP_FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as stream:
            stream.write(json.dumps(line) + "\n")

    def write_placement(self) -> None:
        """``placement.json``'s ``engines``: the current members (the rest of the file as the run wrote it)."""
        path = Path(self.manager.run_dir) / PLACEMENT_FILENAME
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = {}
        before = {e.get("address"): e for e in record.get("engines", []) if isinstance(e, dict)}
        record["engines"] = [self._placement_entry(index, before) for index in self.members()]
        temporary = path.with_name(f".{PLACEMENT_FILENAME}.{os.getpid()}")
        temporary.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(temporary, path)

    def _placement_entry(self, index: int, before: dict[str, dict]) -> dict:
        url = self.manager.engine_urls[index]
        info = self.info.get(index) or self._initial_info(index)
        entry = dict(before.get(url) or {"node_id": info.node_id, "node_ip": info.node_ip, "gpu_ids": info.gpu_ids,
                                         "address": url, "local_checkpoint_dir": self.manager.local_dirs[index]})
        entry.update(engine=index, kind=info.kind, joined=info.joined)
        return entry


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


def _state(index: int, url: str, manager: "EngineManager", routed: dict[str, dict]) -> str:
    if index in manager._lost:
        return "lost"
    if index in manager._down:
        return "down"
    worker = routed.get(url)
    return worker["state"] if worker else "not routed"
