"""One placement group for the job: trainer bundles first, then the critic's (PPO), then rollout engines.

Bundles are ``{"GPU": 1, "CPU": 1}`` (logical GPUs on a CPU machine); with
``--rollout-node-resource NAME`` each engine bundle also asks for a share of the custom
resource ``NAME``, so engines land only on nodes that offer it (clusters commonly label
rollout hosts so). After the group is ready each bundle's (node, IP, GPU id) is read by a short
probe actor and the bundles are sorted by node and GPU id, so a rank or engine index always
maps to the same physical GPU order (with a rollout resource, trainer and engine bundles are
sorted each among their own kind, since they are not interchangeable). The trainer gets the
first ``actor_num_nodes * actor_num_gpus_per_node`` positions, a PPO critic the next
``critic_num_nodes * critic_num_gpus_per_node`` (its own trainer group), rollout the next
``rollout_num_gpus``, split into engines of ``rollout_num_gpus_per_engine`` (each engine on
one node). With ``--colocate`` rollout shares the trainer's bundles.

Planning (:func:`plan_layout`, :func:`order_bundles`) is pure; :func:`create_placement` is
the only part that talks to Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_disagg.config.components import ClusterConfig
from miles_disagg.types import ConfigError

PLACEMENT_TIMEOUT_S = 120.0
NODE_RESOURCE_SHARE = 0.01
"""How much of ``--rollout-node-resource`` each engine bundle asks for: only its presence matters."""


@dataclass(frozen=True)
class Layout:
    """Bundle indices (positions in the sorted order) of the trainer ranks and of each engine."""

    num_bundles: int
    trainer: tuple[int, ...]
    engines: tuple[tuple[int, ...], ...]
    rollout_node_resource: str | None = None
    """Engine bundles ask for a share of this custom resource (None: any node with a free GPU)."""
    critic: tuple[int, ...] = ()
    """Bundle indices of the critic's ranks (PPO; after the trainer's, before the engines')."""

    def is_engine_bundle(self, position: int) -> bool:
        """Whether the bundle requested at ``position`` is an engine's (trainer and critic bundles come first)."""
        return position >= len(self.trainer) + len(self.critic)

    def bundle_resources(self, position: int) -> dict[str, float]:
        """What the bundle requested at ``position`` asks of its node."""
        bundle = {"GPU": 1.0, "CPU": 1.0}
        if self.rollout_node_resource and self.is_engine_bundle(position):
            bundle[self.rollout_node_resource] = NODE_RESOURCE_SHARE
        return bundle


def plan_layout(cluster: ClusterConfig, *, external_rollout: bool = False, critic: bool = False) -> Layout:
    """Pure: which sorted bundle each trainer rank, each critic rank (``critic``: the run trains a
    PPO critic, ``cluster.num_critic_gpus`` of them) and each engine uses.

    External or service rollout launches no engine, so only trainer (and critic) bundles are reserved.
    ``ConfigError`` when the rollout GPUs do not split into whole engines, or when colocated
    engines (which share the trainer's bundles) are asked to go to rollout nodes.
    """
    trainer = tuple(range(cluster.num_actor_gpus))
    critics = tuple(range(len(trainer), len(trainer) + (cluster.num_critic_gpus if critic else 0)))
    training = len(trainer) + len(critics)
    if external_rollout:
        return Layout(training, trainer, (), critic=critics)
    rollout_gpus = cluster.rollout_num_gpus or cluster.num_actor_gpus
    per_engine = cluster.rollout_num_gpus_per_engine
    if rollout_gpus % per_engine:
        raise ConfigError(f"--rollout-num-gpus {rollout_gpus} is not a multiple of --rollout-num-gpus-per-engine "
                          f"{per_engine}", ("--rollout-num-gpus", "--rollout-num-gpus-per-engine"))
    if cluster.colocate:
        if rollout_gpus > len(trainer):
            raise ConfigError(f"--colocate shares the trainer's {len(trainer)} GPUs; --rollout-num-gpus {rollout_gpus} "
                              "asks for more", ("--colocate", "--rollout-num-gpus"))
        if cluster.rollout_node_resource:
            raise ConfigError("--rollout-node-resource places engines on their own nodes; --colocate puts them on "
                              "the trainer's GPUs: give one", ("--rollout-node-resource", "--colocate"))
        first = 0
        total = training
    else:
        first = training
        total = training + rollout_gpus
    engines = tuple(tuple(range(first + i, first + i + per_engine)) for i in range(0, rollout_gpus, per_engine))
    layout = Layout(total, trainer, engines, cluster.rollout_node_resource, critic=critics)
    if cluster.num_gpus_per_node is not None:
        _check_engines_within_nodes(layout, cluster.num_gpus_per_node)
    return layout

def node_of(position: int, num_gpus_per_node: int) -> tuple[int, int]:
    """(node index, GPU index on it) of a sorted bundle position, nodes of ``num_gpus_per_node``
    GPUs filled in order (what PACK placement on whole nodes gives)."""
    return position // num_gpus_per_node, position % num_gpus_per_node


def _check_engines_within_nodes(layout: Layout, num_gpus_per_node: int) -> None:
    for index, bundles in enumerate(layout.engines):
        nodes = {node_of(p, num_gpus_per_node)[0] for p in bundles}
        if len(nodes) > 1:
            raise ConfigError(f"rollout engine {index} would span nodes {sorted(nodes)} (bundles {list(bundles)} on "
                              f"nodes of --num-gpus-per-node {num_gpus_per_node}); an engine runs on one node: make "
                              "the trainer's GPUs and --rollout-num-gpus-per-engine fit whole nodes",
                              ("--num-gpus-per-node", "--rollout-num-gpus-per-engine", "--actor-num-gpus-per-node"))


@dataclass(frozen=True)
class BundleSite:
    """Where a reserved bundle landed."""

    node_id: str
    node_ip: str
    gpu_id: str


def order_bundles(layout: Layout, sites: list[BundleSite]) -> list[int]:
    """Pure: the Ray bundle index for each sorted position (``sites[i]`` = where bundle ``i`` is).

    Sorted by (node, GPU id); with a rollout resource, trainer (and critic) bundles keep the
    training positions and engine bundles the engines' (each sorted among its own kind). ``ConfigError``
    when an engine's GPUs end up on more than one node (an engine runs on one node)."""
    def kind(index: int) -> int:
        return int(bool(layout.rollout_node_resource) and layout.is_engine_bundle(index))

    order = sorted(range(len(sites)), key=lambda i: (kind(i), sites[i].node_id, _gpu_sort_key(sites[i].gpu_id)))
    for number, positions in enumerate(layout.engines):
        nodes = sorted({sites[order[p]].node_ip + " (" + sites[order[p]].node_id[:8] + ")" for p in positions})
        if len(nodes) > 1:
            raise ConfigError(f"engine {number}'s {len(positions)} GPUs were placed on nodes {', '.join(nodes)}; an "
                              "engine runs on one node: make --rollout-num-gpus-per-engine fit in one node's GPUs",
                              ("--rollout-num-gpus-per-engine",))
    return order


@dataclass
class Placement:
    """A ready placement group and the sorted bundle order (``sorted_bundles[i]`` = Ray bundle index)."""

    group: object
    sorted_bundles: list[int]
    gpu_ids: list[str]
    layout: Layout
    node_ids: list[str] | None = None
    """Node of each sorted position."""
    node_ips: list[str] | None = None
    """IP address of that node."""
    driver_node_id: str | None = None
    """The node of the process that made the placement (the run's driver)."""

    def bundle(self, position: int) -> int:
        return self.sorted_bundles[position]

    def strategy(self, position: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                placement_group_bundle_index=self.bundle(position))

    @property
    def spans_nodes(self) -> bool:
        """Whether the driver and the bundles are on more than one node (servers must then be
        reachable from other nodes)."""
        nodes = set(self.node_ids or ()) | ({self.driver_node_id} if self.driver_node_id else set())
        return len(nodes) > 1

    def control_strategy(self):
        """Where the run's control actors go (engine manager, router, rollout manager): the
        driver's node, so they reach each other on loopback. None: anywhere."""
        if not self.driver_node_id:
            return None
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(self.driver_node_id, soft=False)

    def site(self, position: int) -> dict:
        """Node id, node IP and GPU id of a sorted position (for the run's ``placement.json``)."""
        return {"node_id": self.node_ids[position] if self.node_ids else None,
                "node_ip": self.node_ips[position] if self.node_ips else None, "gpu_id": self.gpu_ids[position]}


def create_placement(layout: Layout) -> Placement:
    """Reserve ``layout.num_bundles`` GPU bundles (PACK) and sort them (:func:`order_bundles`).

    ``ConfigError`` (and nothing left reserved or pending) when the cluster cannot provide
    them within ``PLACEMENT_TIMEOUT_S``, or when an engine's bundles span nodes."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([layout.bundle_resources(i) for i in range(layout.num_bundles)], strategy="PACK")
    if not _wait_reserved(group, layout):
        remove_placement_group(group)
        raise _not_reserved(layout)
    # one bundle at a time: the probes then share one Ray worker per node (see _probe_bundle)
    sites = [BundleSite(*ray.get(_probe_bundle(group, i))) for i in range(layout.num_bundles)]
    try:
        order = order_bundles(layout, sites)
    except ConfigError:
        remove_placement_group(group)
        raise
    return Placement(group, order, [sites[i].gpu_id for i in order], layout,
                     node_ids=[sites[i].node_id for i in order], node_ips=[sites[i].node_ip for i in order],
                     driver_node_id=ray.get_runtime_context().get_node_id())


PLACEMENT_PROGRESS_S = 5.0


def _wait_reserved(group, layout: Layout) -> bool:
    """Whether ``group`` was reserved within ``PLACEMENT_TIMEOUT_S``; a progress line every
    ``PLACEMENT_PROGRESS_S`` while the cluster has not granted it."""
    import time

    import ray

    from miles_disagg.tracking import status

    ready_ref, start = group.ready(), time.monotonic()
    while True:
        left = PLACEMENT_TIMEOUT_S - (time.monotonic() - start)
        ready, _ = ray.wait([ready_ref], timeout=max(0.0, min(PLACEMENT_PROGRESS_S, left)))
        if ready:
            return True
        if left <= PLACEMENT_PROGRESS_S:
            return False
        available = ray.available_resources()
        status(f"waiting for the Ray cluster to grant {layout.num_bundles} bundles of 1 GPU + 1 CPU "
               f"({time.monotonic() - start:.0f}s of {PLACEMENT_TIMEOUT_S:.0f}s; free now: "
               f"{available.get('GPU', 0):g} GPUs, {available.get('CPU', 0):g} CPUs)")


def _not_reserved(layout: Layout) -> ConfigError:
    flags = ("--actor-num-gpus-per-node", "--rollout-num-gpus")
    asked = f"could not reserve {layout.num_bundles} GPU bundles within {PLACEMENT_TIMEOUT_S:.0f}s"
    if layout.rollout_node_resource:
        asked += (f" ({layout.num_bundles - len(layout.trainer) - len(layout.critic)} of them on nodes offering "
                  f"--rollout-node-resource {layout.rollout_node_resource!r})")
        flags += ("--rollout-node-resource",)
    return ConfigError(asked, flags)


def _gpu_sort_key(gpu_id: str):
    return (0, int(gpu_id)) if str(gpu_id).isdigit() else (1, str(gpu_id))


def _probe_bundle(group, index: int):
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # max_calls=0: Ray's default for a task that asks for a GPU is a fresh worker process per call
    # (about a CPU-second each); this one never touches the device, so one worker serves them all
    @ray.remote(num_cpus=0.01, num_gpus=0.01, max_calls=0)
    def where() -> tuple[str, str, str]:
        ids = ray.get_gpu_ids()
        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                str(ids[0]) if ids else "0")

    strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)
    return where.options(scheduling_strategy=strategy).remote()
