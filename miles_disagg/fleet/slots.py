"""The engine set's state, in one owner: each engine's slot and the version the set serves.

An engine's *index* is its slot's position: fixed for the run. A slot holds the engine's URL,
its host-local checkpoint directory, its Ray actor (a managed engine; None for an attached one),
the node Ray placed it on, and where it stands: ``down`` (out of the router until restored),
``lost`` (its actor is gone, with its node or alone: placed again, never restarted), ``removed``
(it left the run: ``engines remove``, or a join that failed at its registration). A restart or a
replacement gives the slot a new URL (and actor, node, local directory); a slot is never reused
for another engine.

:class:`EngineSlots` is shared by the engine manager and its parts (the monitor, the router's
bookkeeping, the replacements, membership changes), each in a thread of its own. Readers take no
lock: every read is of one value (or a copy), consistent on its own. ``lock`` (re-entrant) is held
by whoever changes the engine set or the version it serves (an update, a restore, a join, a
leave), for as long as that change must not interleave with another; taking it for a read would
make the monitor wait for a whole weight update.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


@dataclass
class EngineSlot:
    """One engine of the run (see the module docstring)."""

    url: str
    local_dir: str
    actor: Any = None
    node: str | None = None
    down: bool = False
    lost: bool = False
    removed: bool = False
    failures: int = 0
    """Consecutive failed health checks."""
    server_ids: frozenset[str] = frozenset()
    """Who answers at ``url`` (:mod:`miles_disagg.fleet.vetting`); empty: not asked since the
    engine (re)started. Two addresses of one server share an id."""


class EngineSlots:
    """Every engine's slot by index, the version the set serves, and what happened to them."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.version = 0
        """The version every routed engine serves (the last one activated); set under ``lock``."""
        self.broadcast_group = False
        """True once the engines joined a broadcast weight-update group: an NCCL group cannot take a
        new member, so no engine is restarted into it, placed again or joined."""
        self.events: list[dict] = []
        """What happened to the engines (down, restored, node_lost, replaced, joined, ...), oldest first."""
        self._slots: list[EngineSlot] = []
        self._had_actor = False

    # ------------------------------------------------------------------ the set

    def __len__(self) -> int:
        return len(self._slots)

    def indices(self) -> range:
        """Every slot's index, removed ones included (in order)."""
        return range(len(self._slots))

    def add(self, url: str, local_dir: str, *, actor: Any = None, node: str | None = None,
            server_ids: frozenset[str] = frozenset()) -> int:
        """A new engine in the next slot; returns its index. Joins call it holding ``lock``."""
        self._slots.append(EngineSlot(url, local_dir, actor, node, server_ids=frozenset(server_ids)))
        self._had_actor = self._had_actor or actor is not None
        return len(self._slots) - 1

    def members(self) -> list[int]:
        """The engines that have not left the run."""
        return [i for i, slot in enumerate(self._slots) if not slot.removed]

    def record(self, event: dict) -> None:
        """Append to :attr:`events`."""
        self.events.append(event)

    def serving(self) -> int:
        """Members (engines that have not left the run) not down: what the capacity policy counts."""
        return sum(not slot.down and not slot.removed for slot in self._slots)

    # ------------------------------------------------------------------ one engine

    def url(self, index: int) -> str:
        return self._slots[index].url

    def urls(self) -> list[str]:
        """Every slot's URL (a copy), removed ones included."""
        return [slot.url for slot in self._slots]

    def set_url(self, index: int, url: str) -> None:
        """A restarted engine's new address (who answers there is asked again)."""
        slot = self._slots[index]
        slot.url, slot.server_ids = url, frozenset()

    def server_ids(self, index: int) -> frozenset[str]:
        """Who answered at the engine's address when last asked (empty: not asked since it (re)started)."""
        return self._slots[index].server_ids

    def set_server_ids(self, index: int, server_ids: frozenset[str]) -> None:
        self._slots[index].server_ids = frozenset(server_ids)

    def local_dir(self, index: int) -> str:
        return self._slots[index].local_dir

    def local_dirs(self) -> list[str]:
        return [slot.local_dir for slot in self._slots]

    def set_local_dir(self, index: int, local_dir: str) -> None:
        """Where the engine says its host-local checkpoint is (asked once it runs)."""
        self._slots[index].local_dir = local_dir

    def actor(self, index: int) -> Any:
        """The engine's ``EngineProcess`` actor; None for an attached (or a stopped) engine."""
        return self._slots[index].actor

    def set_actor(self, index: int, actor: Any) -> None:
        self._slots[index].actor = actor

    def clear_actors(self) -> None:
        """Every actor stopped (the manager shut down)."""
        for slot in self._slots:
            slot.actor = None

    def is_managed(self, index: int) -> bool:
        return self._slots[index].actor is not None

    @property
    def has_actors(self) -> bool:
        """Whether this run ever gave an engine an actor (a managed run, or one joined by ``engines
        add --managed``): its engines' processes are then checked through their actors."""
        return self._had_actor

    def node(self, index: int) -> str | None:
        """The Ray node id a managed engine of the run's placement runs on (None: not known, or not
        placed by the run's placement group)."""
        return self._slots[index].node

    def set_node(self, index: int, node: str | None) -> None:
        self._slots[index].node = node

    def replace(self, index: int, *, actor: Any, url: str, node: str | None, local_dir: str) -> None:
        """A lost engine placed again: its new actor, address, node and local directory; no longer
        lost, no failed health checks (still down: it is restored next)."""
        slot = self._slots[index]
        slot.actor, slot.url, slot.node, slot.local_dir = actor, url, node, local_dir
        slot.failures, slot.lost, slot.server_ids = 0, False, frozenset()
        self._had_actor = True

    # ------------------------------------------------------------------ where it stands

    def is_down(self, index: int) -> bool:
        return self._slots[index].down

    def down(self) -> set[int]:
        """The indices of the engines out of the router until restored (a copy)."""
        return {i for i, slot in enumerate(self._slots) if slot.down}

    def mark_down(self, index: int) -> bool:
        """Out of the router until restored; False when it was down already."""
        slot = self._slots[index]
        if slot.down:
            return False
        slot.down = True
        return True

    def mark_up(self, index: int) -> None:
        """Restored: in the router again."""
        self._slots[index].down = False

    def is_lost(self, index: int) -> bool:
        return self._slots[index].lost

    def mark_lost(self, index: int) -> None:
        """Its actor is gone: it is placed again, never restarted."""
        self._slots[index].lost = True

    def is_removed(self, index: int) -> bool:
        return self._slots[index].removed

    def mark_removed(self, index: int) -> None:
        """Left the run: later updates, the monitor and restores leave it out."""
        self._slots[index].removed = True

    def count_health_check(self, index: int, ok: bool) -> int:
        """Record one health check; returns the consecutive failures now."""
        slot = self._slots[index]
        slot.failures = 0 if ok else slot.failures + 1
        return slot.failures
