"""The pure placement layout: trainer bundles first, engines next, colocate shares; engines on
rollout nodes (a custom resource); the sorted bundle order; the bind address of managed servers."""

from __future__ import annotations

import pytest

from miles_disagg.config.components import ClusterConfig
from miles_disagg.trainer.placement import NODE_RESOURCE_SHARE, BundleSite, order_bundles, plan_layout
from miles_disagg.types import ConfigError


def test_default_layout_separates_trainer_and_engines() -> None:
    layout = plan_layout(ClusterConfig(actor_num_nodes=1, actor_num_gpus_per_node=4, rollout_num_gpus=4,
                                       rollout_num_gpus_per_engine=2))
    assert layout.num_bundles == 8
    assert layout.trainer == (0, 1, 2, 3)
    assert layout.engines == ((4, 5), (6, 7))


def test_colocated_layout_shares_the_trainer_bundles() -> None:
    layout = plan_layout(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=True))
    assert layout.num_bundles == 2 and layout.trainer == (0, 1) and layout.engines == ((0,), (1,))


def test_external_rollout_reserves_only_the_trainer() -> None:
    layout = plan_layout(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=4), external_rollout=True)
    assert layout.num_bundles == 2 and layout.engines == ()


def test_engines_must_be_whole() -> None:
    with pytest.raises(ConfigError, match="--rollout-num-gpus-per-engine"):
        plan_layout(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=3, rollout_num_gpus_per_engine=2))
    with pytest.raises(ConfigError, match="--colocate"):
        plan_layout(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2, colocate=True))


def test_with_num_gpus_per_node_an_engine_may_not_span_two_nodes() -> None:
    from miles_disagg.trainer.placement import node_of

    fits = plan_layout(ClusterConfig(actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=2,
                                     num_gpus_per_node=4))
    assert [[node_of(p, 4) for p in engine] for engine in fits.engines] == [[(1, 0), (1, 1)], [(1, 2), (1, 3)]]
    with pytest.raises(ConfigError, match="rollout engine 1 would span nodes \\[0, 1\\]") as info:
        plan_layout(ClusterConfig(actor_num_gpus_per_node=3, rollout_num_gpus=4, rollout_num_gpus_per_engine=2,
                                  num_gpus_per_node=6))
    assert "--num-gpus-per-node" in info.value.flags
    # without the flag the node size is unknown: the placement checks the real nodes at start-up
    plan_layout(ClusterConfig(actor_num_gpus_per_node=3, rollout_num_gpus=4, rollout_num_gpus_per_engine=2))


# --------------------------------------------------------------------------- rollout nodes


def test_a_rollout_node_resource_goes_into_engine_bundles_only() -> None:
    layout = plan_layout(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2, rollout_node_resource="rollout"))
    assert [layout.bundle_resources(i) for i in range(layout.num_bundles)] == [
        {"GPU": 1.0, "CPU": 1.0},
        {"GPU": 1.0, "CPU": 1.0, "rollout": NODE_RESOURCE_SHARE},
        {"GPU": 1.0, "CPU": 1.0, "rollout": NODE_RESOURCE_SHARE},
    ]
    plain = plan_layout(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2))
    assert all(plain.bundle_resources(i) == {"GPU": 1.0, "CPU": 1.0} for i in range(3))


def test_colocated_engines_cannot_go_to_rollout_nodes() -> None:
    with pytest.raises(ConfigError, match="--rollout-node-resource") as refused:
        plan_layout(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=True,
                                  rollout_node_resource="rollout"))
    assert refused.value.flags == ("--rollout-node-resource", "--colocate")


@pytest.mark.parametrize("name", ["", "GPU", "CPU", " rollout"])
def test_the_rollout_node_resource_must_be_a_custom_resource(name: str) -> None:
    with pytest.raises(ValueError, match="--rollout-node-resource"):
        ClusterConfig(rollout_node_resource=name)


def _site(node: str, gpu: str) -> BundleSite:
    return BundleSite(node_id=node * 8, node_ip=f"10.0.0.{ord(node) - 96}", gpu_id=gpu)


def test_bundles_sort_by_node_and_gpu_when_interchangeable() -> None:
    layout = plan_layout(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2))
    # Ray bundle 0 (requested first) landed on node b; the trainer takes the first sorted bundle
    order = order_bundles(layout, [_site("b", "0"), _site("a", "1"), _site("a", "0")])
    assert order == [2, 1, 0]


def test_with_a_rollout_resource_trainer_and_engine_bundles_keep_their_kind() -> None:
    layout = plan_layout(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2, rollout_node_resource="r"))
    # the engine bundles (1, 2) are on node a, which sorts before the trainer's node b
    order = order_bundles(layout, [_site("b", "0"), _site("a", "1"), _site("a", "0")])
    assert order[0] == 0  # the trainer keeps its own (resource-free) bundle
    assert order[1:] == [2, 1]  # engines sorted by GPU id on their node


def test_an_engine_split_over_two_nodes_is_refused() -> None:
    layout = plan_layout(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2, rollout_num_gpus_per_engine=2,
                                       rollout_node_resource="r"))
    with pytest.raises(ConfigError, match="engine 0's 2 GPUs were placed on nodes 10.0.0.1 .*10.0.0.2"):
        order_bundles(layout, [_site("a", "0"), _site("a", "1"), _site("b", "0")])

