"""One placement group for the job: trainer bundles first, then rollout engines.

Bundles are ``{"GPU": 1, "CPU": 1}`` (logical GPUs on a CPU machine). After the group is
ready each bundle's (node, GPU id) is read by a short probe actor and the bundles are
sorted by node and GPU id, so a rank or engine index always maps to the same physical
GPU order. The trainer gets the first ``actor_num_nodes * actor_num_gpus_per_node``
bundles, rollout the next ``rollout_num_gpus``, split into engines of
``rollout_num_gpus_per_engine``. With ``--colocate`` rollout shares the trainer's bundles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_disagg.config.components import ClusterConfig
from miles_disagg.types import ConfigError

PLACEMENT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Layout:
    """Bundle indices (positions in the sorted order) of the trainer ranks and of each engine."""

    num_bundles: int
    trainer: tuple[int, ...]
    engines: tuple[tuple[int, ...], ...]


def plan_layout(cluster: ClusterConfig, *, external_rollout: bool = False) -> Layout:
    """Pure: which sorted bundle each trainer rank and each engine uses.

    External or service rollout launches no engine, so only trainer bundles are reserved.
    ``ConfigError`` when the rollout GPUs do not split into whole engines.
    """
    trainer = tuple(range(cluster.num_actor_gpus))
    if external_rollout:
        return Layout(len(trainer), trainer, ())
    rollout_gpus = cluster.rollout_num_gpus or cluster.num_actor_gpus
    per_engine = cluster.rollout_num_gpus_per_engine
    if rollout_gpus % per_engine:
        raise ConfigError(f"--rollout-num-gpus {rollout_gpus} is not a multiple of --rollout-num-gpus-per-engine "
                          f"{per_engine}", ("--rollout-num-gpus", "--rollout-num-gpus-per-engine"))
    if cluster.colocate:
        if rollout_gpus > len(trainer):
            raise ConfigError(f"--colocate shares the trainer's {len(trainer)} GPUs; --rollout-num-gpus {rollout_gpus} "
                              "asks for more", ("--colocate", "--rollout-num-gpus"))
        first = 0
        total = len(trainer)
    else:
        first = len(trainer)
        total = len(trainer) + rollout_gpus
    engines = tuple(tuple(range(first + i, first + i + per_engine)) for i in range(0, rollout_gpus, per_engine))
    layout = Layout(total, trainer, engines)
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


@dataclass
class Placement:
    """A ready placement group and the sorted bundle order (``sorted_bundles[i]`` = Ray bundle index)."""

    group: object
    sorted_bundles: list[int]
    gpu_ids: list[str]
    layout: Layout
    node_ids: list[str] = field(default_factory=list)  # the Ray node of each sorted bundle

    def bundle(self, position: int) -> int:
        return self.sorted_bundles[position]

    def strategy(self, position: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                placement_group_bundle_index=self.bundle(position))


def create_placement(layout: Layout) -> Placement:
    """Reserve ``layout.num_bundles`` GPU bundles (PACK) and sort them by (node, GPU id).

    ``ConfigError`` (and nothing left reserved or pending) when the cluster cannot provide
    them within ``PLACEMENT_TIMEOUT_S``, or when an engine's bundles landed on two nodes."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"GPU": 1, "CPU": 1} for _ in range(layout.num_bundles)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise ConfigError(f"could not reserve {layout.num_bundles} GPU bundles within {PLACEMENT_TIMEOUT_S:.0f}s",
                          ("--actor-num-gpus-per-node", "--rollout-num-gpus"))
    probes = [_probe_bundle(group, i) for i in range(layout.num_bundles)]
    found = ray.get(probes)
    order = sorted(range(layout.num_bundles), key=lambda i: (found[i][0], _gpu_sort_key(found[i][1])))
    for index, bundles in enumerate(layout.engines):
        nodes = {found[order[p]][0] for p in bundles}
        if len(nodes) > 1:
            remove_placement_group(group)
            raise ConfigError(f"rollout engine {index} got GPUs on {len(nodes)} nodes (an engine runs on one node): "
                              "make the trainer's GPUs and --rollout-num-gpus-per-engine fit whole nodes",
                              ("--rollout-num-gpus-per-engine", "--actor-num-gpus-per-node", "--num-gpus-per-node"))
    return Placement(group, order, [found[i][1] for i in order], layout, [found[i][0] for i in order])


def _gpu_sort_key(gpu_id: str):
    return (0, int(gpu_id)) if str(gpu_id).isdigit() else (1, str(gpu_id))


def _probe_bundle(group, index: int):
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0.01, num_gpus=0.01)
    def where() -> tuple[str, str]:
        ids = ray.get_gpu_ids()
        return ray.get_runtime_context().get_node_id(), str(ids[0]) if ids else "0"

    strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)
    return where.options(scheduling_strategy=strategy).remote()
