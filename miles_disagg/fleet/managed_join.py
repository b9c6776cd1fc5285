"""``engines add --managed N``: start N more managed engines on GPUs the cluster has free.

First on the bundles of the run's placement group that removed managed engines freed (``engines
remove`` stops an engine and hands its bundles back: :class:`~miles_disagg.fleet.members.FreedBundles`);
then, the run's placement group having been sized at start, on bundles of their own (one placement
group per engine, its tp size in GPU bundles on one node). A cluster without the free GPUs is
refused at once (nothing started); a group not placed within :data:`PLACE_TIMEOUT_S` is removed and
refused. Each engine starts as the run's own do
(:class:`~miles_disagg.engines.actor.EngineProcess`, the run's backend and flags), after its
node found the base checkpoint. A failure stops whatever this call started.
"""

from __future__ import annotations

import logging
from typing import Any

from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.fleet.members import FreedBundles, MemberInfo, MembershipRefused
from miles_disagg.types import MilesDisaggError

log = logging.getLogger(__name__)

PLACE_TIMEOUT_S = 60.0


def start_managed_engines(config: EngineManagerConfig, count: int, *, first_index: int,
                          freed: list[FreedBundles] | None = None) -> list[tuple[Any, str, MemberInfo]]:
    """``[(actor, url, MemberInfo)]`` of ``count`` started engines (not yet caught up or routed),
    indices from ``first_index`` on: on ``freed`` bundles first (those used are taken out of the
    list; a failure puts them back), then on new placement groups."""
    import ray

    freed = freed if freed is not None else []
    tp = config.cluster.rollout_num_gpus_per_engine
    reused = min(count, len(freed))
    free = ray.available_resources().get("GPU", 0.0)
    if free < (count - reused) * tp:
        also = f" besides the {reused * tp} GPU(s) removed engines freed in the run's placement" if reused else ""
        raise MembershipRefused(f"the cluster has {free:g} GPU(s) free{also}; {count} more engine(s) of "
                                f"--rollout-num-gpus-per-engine {tp} need {count * tp}; nothing was started")
    taken, started = freed[:reused], []
    del freed[:reused]
    try:
        for offset in range(count):
            index = first_index + offset
            started.append(_start_on_freed(config, index, taken[offset]) if offset < reused
                           else _start_one(config, index, tp))
    except BaseException:
        for actor, _url, info in started:
            stop_started(actor, info.placement_group)
        freed[:0] = taken  # stopped again: theirs to give once more
        raise
    return started


def _start_on_freed(config: EngineManagerConfig, index: int, bundles: FreedBundles) -> tuple[Any, str, MemberInfo]:
    from miles_disagg.engines.actor import create_engine_actor
    from miles_disagg.fleet.plan import launch_specs

    spec = launch_specs(config, [bundles.positions] * (index + 1))[index]
    actor = create_engine_actor(spec, bundles.strategy)
    url = _checked_start(actor, None, index)
    site = bundles.site
    return actor, url, MemberInfo("managed", site.get("node_ip"), site.get("node_id"), list(site.get("gpu_ids") or []),
                                  run_bundles=list(bundles.positions))


def _start_one(config: EngineManagerConfig, index: int, tp: int) -> tuple[Any, str, MemberInfo]:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from miles_disagg.engines.actor import create_engine_actor
    from miles_disagg.fleet.plan import launch_specs

    group = placement_group([{"GPU": 1, "CPU": 1}] * tp, strategy="STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=PLACE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        stop_started(None, group)
        raise MembershipRefused(f"engine {index}: the cluster did not place {tp} GPU bundle(s) on one node within "
                                f"{PLACE_TIMEOUT_S:g}s; nothing more was started") from None
    spec = launch_specs(config, [[0] * tp] * (index + 1))[index]
    actor = create_engine_actor(spec, PlacementGroupSchedulingStrategy(placement_group=group,
                                                                       placement_group_bundle_index=0))
    url = _checked_start(actor, group, index)
    node_id, node_ip = _node_of(group)
    return actor, url, MemberInfo("managed", node_ip, node_id, [], placement_group=group)


def _checked_start(actor: Any, group: Any, index: int) -> str:
    """The engine's node must see the base checkpoint; then it starts. A failure stops it (and ``group``)."""
    import ray

    try:
        problems = ray.get(actor.check_paths.remote(None))
        if problems:
            raise MembershipRefused(f"engine {index}'s node lacks a shared path: {'; '.join(problems)}")
        return ray.get(actor.start.remote())
    except BaseException:
        stop_started(actor, group)
        raise


def _node_of(group: Any) -> tuple[str | None, str | None]:
    import ray
    from ray.util.placement_group import placement_group_table

    node_id = (placement_group_table(group).get("bundles_to_node_id") or {}).get(0)
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return node_id, ips.get(node_id)


def stop_started(actor: Any, group: Any) -> None:
    """Stop an engine this module started (and remove its placement group)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    if actor is not None:
        try:
            ray.get(actor.stop.remote(), timeout=60)
        except (MilesDisaggError, ray.exceptions.RayError) as exc:
            log.info("stopping a joining engine: %s", exc)
        ray.kill(actor)
    if group is not None:
        remove_placement_group(group)
