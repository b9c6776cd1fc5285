"""Where a run's pieces ran, and what happens when a node goes away.

* :func:`placement_record` / :func:`write_placement`: the run directory's ``placement.json``,
  for every trainer rank and engine its node id, node IP, GPU ids and address (plus the router
  and the driver), written once the run has started.
* :class:`NodeWatch`: registered with :func:`miles_disagg.remote.add_watch` for the run's
  lifetime. A node that leaves the cluster with only rollout engines on it costs capacity, not
  the run, when the engine manager places engines again (managed engines, disk-delta): the watch
  says so in one status line and the engine manager takes the engines out and places them again
  (:mod:`miles_disagg.fleet.replace`; the run ends only under ``--min-rollout-engines``,
  :mod:`miles_disagg.loop.capacity`). A node with a trainer rank on it (or any node, when engines
  are not placed again: broadcast mode) ends every wait of the driver with
  :class:`~miles_disagg.types.NodeLost` naming the node and what ran there (the launcher turns it
  into one line and exit 1) - unless the run gave ``on_trainer_node_lost``, the seam a trainer
  restart path uses to take the loss over instead.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from miles_disagg.loop.run_files import ENGINE_EVENTS_FILENAME, PLACEMENT_FILENAME
from miles_disagg.tracking import status
from miles_disagg.types import MilesDisaggError, NodeLost

if TYPE_CHECKING:
    from miles_disagg.fleet.handle import EngineManagerHandle
    from miles_disagg.trainer.placement import Placement

NODE_CHECK_INTERVAL_S = 2.0


def work_by_node(placement: Placement) -> dict[str, dict]:
    """``node_id -> {"node_ip", "work": [...]}``: what the placement put on each node."""
    nodes: dict[str, dict] = {}

    def add(position: int, what: str) -> None:
        entry = nodes.setdefault(placement.node_ids[position], {"node_ip": placement.node_ips[position], "work": []})
        if what not in entry["work"]:
            entry["work"].append(what)

    for rank, position in enumerate(placement.layout.trainer):
        add(position, f"trainer rank {rank}")
    for index, positions in enumerate(placement.layout.engines):
        for position in positions:
            add(position, f"engine {index}")
    return nodes


TrainerNodeLost = Callable[[NodeLost], None]
"""Takes a trainer node's loss over (a trainer restart); raising ends the run with that error."""


class NodeWatch:
    """Watches the placement's nodes (asks the GCS at most every ``NODE_CHECK_INTERVAL_S``).

    A lost node with only engines on it is reported once and tolerated when ``engines_replaced``;
    one with a trainer rank goes to ``on_trainer_node_lost`` when given; any other loss raises
    :class:`NodeLost`, and after that every call raises it again."""

    def __init__(self, nodes: dict[str, dict], alive_nodes: Callable[[], set[str]] | None = None,
                 interval_s: float = NODE_CHECK_INTERVAL_S, *, engines_replaced: bool = False,
                 on_trainer_node_lost: TrainerNodeLost | None = None):
        """``nodes``: :func:`work_by_node`'s map; ``alive_nodes``: the ids of the cluster's live
        nodes (default: asked of Ray's GCS); ``engines_replaced``: the engine manager places a lost
        node's engines again (the run goes on); ``on_trainer_node_lost``: the trainer path's handler."""
        self.nodes, self.interval_s = nodes, interval_s
        self.engines_replaced, self.on_trainer_node_lost = engines_replaced, on_trainer_node_lost
        self._alive_nodes = alive_nodes or _alive_ray_nodes
        self._checked = -interval_s
        self._lost: MilesDisaggError | None = None
        self.handled: list[str] = []
        """Ids of the lost nodes the run went on without (rollout nodes, or taken over trainer nodes)."""

    @classmethod
    def of(cls, placement: Placement, *, engines_replaced: bool = False,
           on_trainer_node_lost: TrainerNodeLost | None = None) -> "NodeWatch":
        return cls(work_by_node(placement) if placement.node_ids else {}, engines_replaced=engines_replaced,
                   on_trainer_node_lost=on_trainer_node_lost)

    def __call__(self) -> None:
        if self._lost is None and time.monotonic() - self._checked >= self.interval_s:
            self._checked = time.monotonic()
            self._lost = self._find_lost()
        if self._lost is not None:
            raise self._lost

    def unwatch(self, node_id: str) -> None:
        """Stop watching ``node_id`` (a trainer restart took its loss over). The other nodes stay
        watched with everything the watch knows (the lost rollout nodes the run already went on
        without, whether engines are placed again, the trainer-node handler); a loss of ``node_id``
        the watch kept raising is forgotten, so later calls raise only for another node."""
        self.nodes = {node: site for node, site in self.nodes.items() if node != node_id}
        if getattr(self._lost, "node_id", None) == node_id:
            self._lost = None

    def _find_lost(self) -> MilesDisaggError | None:
        alive = self._alive_nodes()
        for node_id, site in self.nodes.items():
            if node_id in alive or node_id in self.handled:
                continue
            lost = self._handle(node_id, site)
            if lost is not None:
                return lost
        return None

    def _handle(self, node_id: str, site: dict) -> MilesDisaggError | None:
        """What the loss of ``node_id`` does: None when the run goes on, else the error that ends it."""
        where, work = f"node {site['node_ip']} (id {node_id}) left the Ray cluster", ", ".join(site["work"])
        has_trainer = any(w.startswith("trainer") for w in site["work"])
        if not has_trainer and self.engines_replaced:
            status(f"{where}; {work} ran there: out of the router now, placed again when the cluster offers "
                   "their resources (the run goes on with the other engines)")
            self.handled.append(node_id)
            return None
        lost = NodeLost(f"{where}; {work} ran there, so the run cannot go on", node_id=node_id,
                        node_ip=site["node_ip"])
        if has_trainer and self.on_trainer_node_lost is not None:
            try:
                self.on_trainer_node_lost(lost)
            except MilesDisaggError as exc:  # the handler could not take it over: the run ends with its error
                return exc
            self.handled.append(node_id)
            return None
        return lost


def _alive_ray_nodes() -> set[str]:
    import ray

    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}


def placement_record(placement: Placement, *, trainer_address: str | None, engines: EngineManagerHandle | None,
                     router_url: str | None, engines_attached: bool, sessions_url: str | None = None) -> dict:
    """What ``placement.json`` holds for a started run. ``trainer_address``: the trainer group's
    rendezvous address (rank 0's entry; None: the run has no trainer); ``engines``: the engine set
    (None: no engines, or the rollout service at ``router_url``); ``engines_attached``: the engines
    were attached (``--rollout-external``), so no bundle of the placement is theirs."""
    import ray

    record: dict = {"driver": {"node_id": ray.get_runtime_context().get_node_id(),
                               "node_ip": ray.util.get_node_ip_address()},
                    "spans_nodes": placement.spans_nodes, "trainer": [], "engines": [], "router": None}
    if trainer_address is not None:
        for rank, position in enumerate(placement.layout.trainer):
            site = placement.site(position)
            record["trainer"].append({"rank": rank, "node_id": site["node_id"], "node_ip": site["node_ip"],
                                      "gpu_ids": [site["gpu_id"]],
                                      "address": trainer_address if rank == 0 else site["node_ip"]})
    if engines is not None:
        record["engines"] = _engine_records(placement, engines, engines_attached)
        record["router"] = {"address": engines.router_url, **record["driver"]}
    elif router_url:
        record["rollout_service"] = {"address": router_url}
    if sessions_url:  # --use-session-server: the session endpoint (rollout/sessions/app.py), on the driver's node
        record["sessions"] = {"address": sessions_url, **record["driver"]}
    return record


def _engine_records(placement: Placement, engines: EngineManagerHandle, engines_attached: bool) -> list[dict]:
    managed = bool(placement.layout.engines) and not engines_attached
    records = []
    for index, url in enumerate(engines.engine_urls):
        entry = {"engine": index, "node_id": None, "node_ip": None, "gpu_ids": [], "address": url,
                 "local_checkpoint_dir": engines.local_dirs[index] if index < len(engines.local_dirs) else None}
        if managed:
            positions = placement.layout.engines[index]
            first = placement.site(positions[0])
            entry.update(node_id=first["node_id"], node_ip=first["node_ip"],
                         gpu_ids=[placement.site(p)["gpu_id"] for p in positions])
        records.append(entry)
    return records


def write_placement(run_dir: str | Path, record: dict) -> Path:
    path = Path(run_dir) / PLACEMENT_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def write_engine_events(run_dir: str | Path, events: list[dict]) -> Path:
    """``engine_events.json``: what happened to the engines during the run (the engine manager's
    events: ``down``, ``restored``, ``node_lost``, ``actor_lost``, ``replaced``, ...), oldest first."""
    path = Path(run_dir) / ENGINE_EVENTS_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(events, indent=2) + "\n")
    return path
