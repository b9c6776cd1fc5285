"""The run's members as it records them: who each engine is, the files that say so, and the refusals.

Every membership change is appended to ``membership.jsonl`` in the run directory (time, action, url,
engine, kind, version, node, why) and ``placement.json``'s ``engines`` are rewritten to the current
members (:class:`MemberRecords`). :class:`MemberInfo` is what the run knows of an engine beyond its
slot (:mod:`miles_disagg.fleet.slots`): managed or attached, where it runs, since when.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from miles_disagg.fleet.slots import EngineSlots
from miles_disagg.fleet.vetting import check_engine_url
from miles_disagg.types import InvalidInput, ReplaceReplica

MEMBERSHIP_FILENAME = "membership.jsonl"
PLACEMENT_FILENAME = "placement.json"  # the run's (miles_disagg.loop.cluster writes it at start)


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
    """What the run knows of one engine beyond its slot."""

    kind: str  # "managed" or "attached"
    node_ip: str | None = None
    node_id: str | None = None
    gpu_ids: list[str] = field(default_factory=list)
    joined: float = field(default_factory=time.time)
    placement_group: Any = None  # a managed engine added mid-run: its own bundles
    run_bundles: list[int] | None = None  # one added on the bundles of a removed engine of the run's placement


@dataclass(frozen=True)
class FreedBundles:
    """The run's placement-group bundles of a managed engine that ``engines remove`` stopped: GPUs a
    ``--managed`` add starts an engine on before it asks the cluster for more."""

    positions: list[int]
    """Their positions in the run's placement (one per GPU of the engine)."""
    strategy: Any
    """The Ray scheduling strategy of the first one (where the engine's actor goes)."""
    site: dict
    """Where they are: ``node_id``, ``node_ip``, ``gpu_ids``."""


def normalize(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``; ``InvalidInput`` for anything
    that is not an engine address (credentials, a path, no port: :func:`~miles_disagg.fleet.vetting.check_engine_url`)."""
    url = url.strip().rstrip("/")
    return check_engine_url(url if "://" in url else f"http://{url}")


class MemberRecords:
    """Each member's :class:`MemberInfo`, ``membership.jsonl`` and ``placement.json`` of ``run_dir``.
    ``placement``: the run's (None for a run that launched nothing)."""

    def __init__(self, run_dir: str | Path, slots: EngineSlots, placement: Any = None):
        self.run_dir = Path(run_dir)
        self.slots = slots
        self.placement = placement
        self.info: dict[int, MemberInfo] = {}
        self.started = False
        """True once :meth:`record_start` wrote the stream's first lines (changes are recorded from then)."""

    def info_of(self, index: int) -> MemberInfo:
        return self.info.get(index) or self._initial_info(index)

    def _initial_info(self, index: int) -> MemberInfo:
        """An engine the run started with: managed ones where the run's placement put them."""
        placement = self.placement
        if self.slots.has_actors and placement is not None and index < len(placement.layout.engines):
            positions = placement.layout.engines[index]
            site = placement.site(positions[0])
            return MemberInfo("managed", site["node_ip"], site["node_id"],
                              [placement.site(p)["gpu_id"] for p in positions])
        return MemberInfo("attached", urlsplit(self.slots.url(index)).hostname)

    def record_start(self) -> None:
        """The engines the run started with: the stream's first lines."""
        for index in self.slots.members():
            self.info.setdefault(index, self._initial_info(index))
            self.record("start", index, why="engine the run started with")
        self.started = True

    def record(self, action: str, index: int, *, why: str, version: int | None = None, **extra: Any) -> None:
        """One line of ``membership.jsonl`` (``version``: the set's current one unless given)."""
        info = self.info_of(index)
        line = {"time": time.time(), "action": action, "url": self.slots.url(index), "engine": index,
                "kind": info.kind, "version": self.slots.version if version is None else version,
                "node": info.node_ip, "node_id": info.node_id, "why": why, **extra}
        path = self.run_dir / MEMBERSHIP_FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as stream:
            stream.write(json.dumps(line) + "\n")

    def write_placement(self) -> None:
        """``placement.json``'s ``engines``: the current members (the rest of the file as the run wrote it)."""
        path = self.run_dir / PLACEMENT_FILENAME
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = {}
        before = {e.get("address"): e for e in record.get("engines", []) if isinstance(e, dict)}
        record["engines"] = [self._placement_entry(index, before) for index in self.slots.members()]
        temporary = path.with_name(f".{PLACEMENT_FILENAME}.{os.getpid()}")
        temporary.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(temporary, path)

    def _placement_entry(self, index: int, before: dict[str, dict]) -> dict:
        url = self.slots.url(index)
        info = self.info_of(index)
        entry = dict(before.get(url) or {"node_id": info.node_id, "node_ip": info.node_ip, "gpu_ids": info.gpu_ids,
                                         "address": url, "local_checkpoint_dir": self.slots.local_dir(index)})
        entry.update(engine=index, kind=info.kind, joined=info.joined)
        return entry
