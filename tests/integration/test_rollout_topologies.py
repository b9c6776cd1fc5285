"""Placement on a real (logical-GPU) Ray cluster, and attaching engines by address.

Placement: ``create_placement(plan_layout(...))`` for the default, colocated and external
layouts; a task scheduled with ``placement.strategy(pos)`` must land on the GPU the
placement reports for ``pos``.

Attach: an ``EngineManager`` (in this process: attaching launches no Ray actor) attaches a
built-in engine by ``host:port``. A matching engine is registered with the manager's router
at version 0; every mismatch the job can detect (tp size, dtype, architecture, context
length) is refused with a ``ConfigError`` naming the field and both values, and the router
the manager had started is stopped again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_fixtures import start_engine, stop_engine, wait_until
from rollout_fixtures import checkpoint_copy, ray_session
from miles_disagg.config.components import ClusterConfig, RolloutConfig, WeightUpdateConfig
from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.fleet.manager import EngineManager
from miles_disagg.router.client import RouterClient
from miles_disagg.trainer.placement import create_placement, plan_layout
from miles_disagg.types import ConfigError

pytestmark = pytest.mark.timeout(180)


# --------------------------------------------------------------------------- placement


@pytest.fixture(scope="module")
def ray_cluster():
    with ray_session(num_gpus=8):
        yield


_GPU_IDS = None


def gpu_ids_by_position(placement) -> list[list[str]]:
    """For each sorted position, the GPU ids Ray gives a task scheduled with ``placement.strategy(pos)``."""
    import ray

    global _GPU_IDS
    if _GPU_IDS is None:
        @ray.remote(num_cpus=0.01, num_gpus=0.01)
        def gpu_ids() -> list[str]:
            return [str(i) for i in ray.get_gpu_ids()]

        _GPU_IDS = gpu_ids
    tasks = [_GPU_IDS.options(scheduling_strategy=placement.strategy(p)).remote()
             for p in range(placement.layout.num_bundles)]
    return ray.get(tasks, timeout=60)


@pytest.fixture
def placed(ray_cluster):
    """``placed(cluster, external_rollout=False)`` -> a ready Placement, removed after the test."""
    from ray.util.placement_group import remove_placement_group

    made = []

    def make(cluster: ClusterConfig, external_rollout: bool = False):
        placement = create_placement(plan_layout(cluster, external_rollout=external_rollout))
        made.append(placement)
        return placement

    yield make
    for placement in made:
        remove_placement_group(placement.group)


def placed_gpus(placement) -> list[str]:
    """Checks that the sorted bundles cover the group and that each position's task runs on
    exactly the GPU the placement reports for it; returns those GPU ids by position."""
    from ray.util.placement_group import placement_group_table

    n = placement.layout.num_bundles
    assert len(placement_group_table(placement.group)["bundles"]) == n
    assert sorted(placement.sorted_bundles) == list(range(n))
    assert placement.gpu_ids == sorted(placement.gpu_ids, key=int)
    seen = gpu_ids_by_position(placement)
    assert seen == [[gpu] for gpu in placement.gpu_ids]
    return [ids[0] for ids in seen]


def test_default_layout_gives_trainer_and_each_engine_their_own_gpus(placed):
    placement = placed(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=4, rollout_num_gpus_per_engine=2))
    assert placement.layout.trainer == (0, 1)
    assert placement.layout.engines == ((2, 3), (4, 5))
    gpus = placed_gpus(placement)
    assert len(set(gpus)) == 6, f"positions share GPUs: {gpus}"


def test_a_one_node_job_binds_loopback(placed):
    """The bind decision reads the placement: one node, so every managed server binds 127.0.0.1."""
    from miles_disagg.net.netbind import LOOPBACK, bind_host, job_spans_nodes

    placement = placed(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=1))
    assert len(placement.node_ids) == placement.layout.num_bundles and len(set(placement.node_ids)) == 1
    assert not job_spans_nodes(placement.node_ids)
    assert bind_host(spans_nodes=job_spans_nodes(placement.node_ids)) == LOOPBACK
    assert job_spans_nodes([*placement.node_ids, "another-node"])  # a placement over two nodes would not


def test_colocated_layout_puts_each_engine_on_a_trainer_gpu(placed):
    placement = placed(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=True))
    assert placement.layout.num_bundles == 2
    assert placement.layout.trainer == (0, 1)
    assert placement.layout.engines == ((0,), (1,))
    gpus = placed_gpus(placement)
    assert [gpus[e[0]] for e in placement.layout.engines] == [gpus[r] for r in placement.layout.trainer]
    assert len(set(gpus)) == 2


def test_external_rollout_reserves_only_the_trainer_bundles(placed):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    placement = placed(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=4), external_rollout=True)
    assert placement.layout.num_bundles == 2 and placement.layout.trainer == (0, 1)
    assert placement.layout.engines == ()
    assert len(set(placed_gpus(placement))) == 2
    # nothing else is held: the other 6 of the 8 GPUs can be reserved at once
    rest = placement_group([{"GPU": 1, "CPU": 0.1}] * 6)
    try:
        assert ray.get(rest.ready(), timeout=30)
    finally:
        remove_placement_group(rest)


def test_a_layout_the_cluster_cannot_hold_fails_with_config_error_and_reserves_nothing(ray_cluster, monkeypatch):
    from ray.util.placement_group import placement_group_table

    from miles_disagg.trainer import placement as placement_module

    monkeypatch.setattr(placement_module, "PLACEMENT_TIMEOUT_S", 1.0)
    layout = plan_layout(ClusterConfig(actor_num_gpus_per_node=4, rollout_num_gpus=6))  # 10 of 8 GPUs
    with pytest.raises(ConfigError, match="could not reserve 10 GPU bundles") as refused:
        create_placement(layout)
    assert "--rollout-num-gpus" in refused.value.flags
    states = {pg["state"] for pg in placement_group_table().values()}
    assert "PENDING" not in states, f"the refused placement group is still pending: {states}"


def test_the_wait_for_bundles_prints_what_it_waits_for(ray_cluster, monkeypatch, capsys):
    from miles_disagg.trainer import placement as placement_module

    monkeypatch.setattr(placement_module, "PLACEMENT_TIMEOUT_S", 2.0)
    monkeypatch.setattr(placement_module, "PLACEMENT_PROGRESS_S", 0.5)
    with pytest.raises(ConfigError, match="could not reserve 10 GPU bundles"):
        create_placement(plan_layout(ClusterConfig(actor_num_gpus_per_node=4, rollout_num_gpus=6)))
    err = capsys.readouterr().err
    assert "waiting for the Ray cluster to grant 10 bundles of 1 GPU + 1 CPU" in err and "free now: 8 GPUs" in err


def test_a_cluster_without_the_gpus_asked_for_is_refused_at_once(ray_cluster, monkeypatch):
    from miles_disagg.loop.ray_start import _check_cluster_offers

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # what the run would have joined
    with pytest.raises(ConfigError, match="the Ray cluster at 10.0.0.1:6379 has 8 GPUs and 8 CPUs; this run asks "
                                          "for 10 bundles") as refused:
        _check_cluster_offers(10)
    assert "--rollout-num-gpus" in refused.value.flags
    _check_cluster_offers(8)  # what it holds: no error


# --------------------------------------------------------------------------- attach by address


@pytest.fixture(scope="module")
def attached_engine(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("attach-engine")
    handle = start_engine(tiny_qwen3_dir, root, *roots_args(root))
    handle.store = root / "store"
    yield handle
    stop_engine(handle)


def roots_args(root: Path, local: str = "local") -> list[str]:
    """An attached built-in engine's roots: the job's store, its own local checkpoint."""
    return ["--weight-store-dir", str(root / "store"), "--local-checkpoint-dir", str(root / local)]


def attach_manager(addr: str, model_path: Path, run_dir: Path, *, tp: int = 1, dtype: str = "auto",
                   store: Path | None = None) -> EngineManager:
    return EngineManager(EngineManagerConfig(
        cluster=ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus_per_engine=tp),
        rollout=RolloutConfig(rollout_external=True, rollout_external_engine_addrs=[addr], engine_dtype=dtype,
                              rollout_health_check_interval=0.2),
        weights=WeightUpdateConfig(update_weight_transfer_mode="disk-delta",
                                   update_weight_disk_dir=str(store or run_dir / "store")),
        model_path=str(model_path), run_dir=str(run_dir)))


def test_a_matching_engine_is_attached_and_registered_at_version_0(attached_engine, tiny_qwen3_dir, tmp_path):
    addr = attached_engine.url.removeprefix("http://")
    manager = attach_manager(addr, tiny_qwen3_dir, tmp_path, store=attached_engine.store)
    try:
        info = manager.start()
        assert info["engine_urls"] == [attached_engine.url]
        with RouterClient(info["router_url"]) as router:
            [worker] = router.list_workers()
        assert (worker["url"], worker["state"], worker["weight_version"]) == (attached_engine.url, "ready", 0)
        assert manager.versions() == ["0"]
    finally:
        manager.shutdown()
    assert manager.router.proc.poll() is not None, "shutdown left the router running"
    assert attached_engine.get("/health").status_code == 200, "shutdown stopped an engine it does not own"


def _arch_copy(model: Path, tmp: Path) -> Path:
    return checkpoint_copy(model, tmp / "llama-labelled", architectures=["LlamaForCausalLM"])


def _long_context_copy(model: Path, tmp: Path) -> Path:
    return checkpoint_copy(model, tmp / "long-context", max_position_embeddings=8192)


@pytest.mark.parametrize("case, kwargs, make_model, expected", [
    ("tp_size", {"tp": 2}, None, ["tp_size", "tp_size=1", "--rollout-num-gpus-per-engine is 2"]),
    ("dtype", {"dtype": "bfloat16"}, None, ["dtype", "serves float32", "expects bfloat16"]),
    ("architecture", {}, _arch_copy, ["architectures", "Qwen3ForCausalLM", "LlamaForCausalLM"]),
    ("context_length", {}, _long_context_copy, ["context_length", "accepts 2048", "needs 8192"]),
], ids=["tp_size", "dtype", "architecture", "context_length"])
def test_a_mismatching_engine_is_refused_and_nothing_is_left_running(
        attached_engine, tiny_qwen3_dir, tmp_path, case, kwargs, make_model, expected):
    model = make_model(tiny_qwen3_dir, tmp_path) if make_model else tiny_qwen3_dir
    addr = attached_engine.url.removeprefix("http://")
    manager = attach_manager(addr, model, tmp_path, store=attached_engine.store, **kwargs)
    try:
        with pytest.raises(ConfigError) as refused:
            manager.start()
        message = str(refused.value)
        assert addr in message
        for part in expected:
            assert part in message, f"{part!r} not in {message!r}"
        assert "--rollout-external-engine-addrs" in refused.value.flags
        assert manager.router is not None, "the router is started before engines are attached"
        assert manager.router.proc.poll() is not None, "a refused attach left the manager's router running"
    finally:
        manager.shutdown()
    assert attached_engine.get("/health").status_code == 200


def test_an_attached_engine_that_comes_back_is_rechecked_and_brought_to_the_current_version(tiny_qwen3_dir, tmp_path):
    """The attached engine dies; the router drops it at once. It comes back on the same address
    (as the deployment would restart it) and is re-checked and restored to the current version
    before the router uses it again."""
    from rollout_fixtures import VersionSource

    from miles_disagg.engines.launch import free_port, launch_engine

    port = free_port()
    engine = launch_engine(tiny_qwen3_dir, log_path=tmp_path / "engine-a.log", port=port,
                           extra_args=roots_args(tmp_path))
    manager = attach_manager(f"127.0.0.1:{port}", tiny_qwen3_dir, tmp_path)
    versions = None
    try:
        info = manager.start()
        versions = VersionSource(tmp_path / "store", tiny_qwen3_dir)
        version = versions.publish_next(seed=3)
        manager.update_weights(version)
        engine.stop()
        with RouterClient(info["router_url"]) as router:
            wait_until(lambda: router.list_workers() == [], timeout=30, what="the dead engine leaves the router")
            engine = launch_engine(tiny_qwen3_dir, log_path=tmp_path / "engine-b.log", port=port,
                                   extra_args=roots_args(tmp_path))  # back at v0

            def restored() -> bool:
                return [(w["url"], w["state"], w["weight_version"]) for w in router.list_workers()] == [
                    (engine.url, "ready", version)]

            wait_until(restored, timeout=60, what="the engine re-registered at the current version")
        assert manager.versions() == [str(version)]
        kinds = [e["event"] for e in manager.info()["events"]]
        assert kinds.index("down") < kinds.index("restored")
    finally:
        if versions is not None:
            versions.close()
        manager.shutdown()
        engine.stop()


def test_an_engine_serving_another_version_is_refused_in_broadcast_mode(tiny_qwen3_dir, tmp_path):
    """Broadcast mode has no store to bring an attached engine back to the base: exit 2, one line."""
    from rollout_fixtures import VersionSource

    from miles_disagg.engines.client import EngineClient
    from miles_disagg.engines.launch import launch_engine

    engine = launch_engine(tiny_qwen3_dir, log_path=tmp_path / "engine.log",
                           extra_args=["--weight-store-dir", str(tmp_path / "earlier-store"),
                                       "--local-checkpoint-dir", str(tmp_path / "local")])
    versions = VersionSource(tmp_path / "earlier-store", tiny_qwen3_dir)
    try:
        versions.publish_next(seed=1)
        with EngineClient(engine.url, store_dir=tmp_path / "earlier-store", local_checkpoint_dir=tmp_path / "local") as c:
            c.pull(1)
            c.load(1)
        manager = attach_manager(engine.url.removeprefix("http://"), tiny_qwen3_dir, tmp_path)
        manager.weights.update_weight_transfer_mode = "broadcast"
        with pytest.raises(ConfigError, match="serves weight version '1'.*broadcast mode cannot reset"):
            manager.start()
        assert manager.router.proc.poll() is not None, "a failed start left the router running"
    finally:
        versions.close()
        engine.stop()
