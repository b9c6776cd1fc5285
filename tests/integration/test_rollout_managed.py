"""Managed engines end to end: the engine manager as a Ray actor in a real placement group,
two built-in engines behind its router, versions published with ``DeltaPublisher``.

The module shares one manager and its two engines; the tests run in order and each leaves
both engines registered at the manager's current version (the kill tests wait for the
restart). What each test checks is in its docstring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine_fixtures import wait_until
from rollout_fixtures import RETRYABLE_STATUSES, Load, RecordingManager, VersionSource, ray_session, running_requests
from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.config.components import ClusterConfig, RolloutConfig, WeightUpdateConfig
from miles_disagg.router.client import RouterClient
from miles_disagg.trainer.placement import create_placement, plan_layout

pytestmark = pytest.mark.timeout(240)

LONG_TOKENS = 300
RESTART_TIMEOUT_S = 90.0


@dataclass
class World:
    manager: object  # Ray actor handle of RecordingManager
    router_url: str
    router: RouterClient
    http: httpx.Client
    versions: VersionSource
    run_dir: Path

    def call(self, method: str, *args, timeout: float = 120.0):
        import ray

        return ray.get(getattr(self.manager, method).remote(*args), timeout=timeout)

    def engine_urls(self) -> list[str]:
        return self.call("info")["engine_urls"]

    def version(self) -> int:
        return self.call("info")["version"]

    def wait_all_ready(self, version: int) -> list[str]:
        """Until the router lists every engine the manager holds ready at ``version``."""
        def ready() -> bool:
            urls = self.engine_urls()
            workers = {w["url"]: w for w in self.router.list_workers()}
            return all(u in workers and workers[u]["state"] == "ready" and workers[u]["weight_version"] == version
                       for u in urls)

        wait_until(ready, timeout=RESTART_TIMEOUT_S, what=f"every engine ready at v{version}")
        return self.engine_urls()

    def publish_and_activate(self) -> int:
        version = self.versions.publish_next(seed=self.version() + 100)
        self.call("update_weights", version)
        return version


@pytest.fixture(scope="module")
def world(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    import ray

    run_dir = tmp_path_factory.mktemp("managed-run")
    store = run_dir / "store"
    cluster = ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2, rollout_num_gpus_per_engine=1)
    rollout = RolloutConfig(rollout_backend="builtin", rollout_health_check_interval=0.2,
                            pause_generation_mode="retract", use_fault_tolerance=True)
    weights = WeightUpdateConfig(update_weight_transfer_mode="disk-delta", update_weight_disk_dir=str(store))
    with ray_session(num_gpus=4):
        placement = create_placement(plan_layout(cluster))
        config = EngineManagerConfig(cluster=cluster, rollout=rollout, weights=weights, model_path=str(tiny_qwen3_dir),
                                     run_dir=str(run_dir))
        manager = ray.remote(RecordingManager).options(num_cpus=0, max_concurrency=8).remote(config, placement=placement)
        versions = None
        try:
            info = ray.get(manager.start.remote(), timeout=180)
            versions = VersionSource(store, tiny_qwen3_dir)
            with RouterClient(info["router_url"]) as router, \
                    httpx.Client(base_url=info["router_url"], timeout=60.0, trust_env=False) as http:
                yield World(manager, info["router_url"], router, http, versions, run_dir)
        finally:
            if versions is not None:
                versions.close()
            ray.get(manager.shutdown.remote(), timeout=60)


def generate(world: World, **extra) -> httpx.Response:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}, **extra}
    return world.http.post("/generate", json=body)


def served_meta(world: World, extra: dict, timeout_s: float = 30.0) -> dict:
    """``meta_info`` of a short request, retried (as a rollout client does) on a retryable answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = generate(world, **extra)
        if response.status_code == 200:
            return response.json()["meta_info"]
        assert response.status_code in RETRYABLE_STATUSES and response.json()["retryable"] is True, response.text
        assert time.monotonic() < deadline, f"still refused after {timeout_s}s: {response.text}"
        time.sleep(0.05)


def served_versions(answer_body: dict) -> tuple:
    meta = answer_body["meta_info"]
    return meta["weight_version_start"], meta["weight_version_end"]


def assert_retryable(answer) -> None:
    assert answer.status in RETRYABLE_STATUSES, f"status {answer.status}: {answer.body or answer.error}"
    assert isinstance(answer.body, dict) and answer.body.get("retryable") is True, answer.body


def test_managed_engines_start_and_register_at_version_0(world):
    urls = world.engine_urls()
    assert len(urls) == 2 and len(set(urls)) == 2
    assert all(u.startswith("http://127.0.0.1:") for u in [*urls, world.router_url]), "a one-node job binds loopback"
    assert {w["url"]: (w["state"], w["weight_version"]) for w in world.router.list_workers()} == {
        u: ("ready", 0) for u in urls}
    assert world.call("versions") == ["0", "0"]


def test_disk_delta_update_prepares_everywhere_before_any_pause_while_generation_runs(world):
    """Publish v+1, then ``update_weights`` while 4 clients keep long requests in flight on both engines."""
    before = world.version()
    urls = world.engine_urls()
    target = world.versions.publish_next(seed=1)
    assert target == before + 1
    load = Load(world.router_url, concurrency=4, max_new_tokens=LONG_TOKENS)
    try:
        wait_until(lambda: all(running_requests(u) >= 1 for u in urls), timeout=60,
                   what="long requests in flight on both engines")
        metrics = world.call("update_weights", target)
        updated = time.monotonic()
        wait_until(lambda: sum(a.sent_at > updated and a.status == 200 for a in load.answers) >= 2, timeout=60,
                   what="requests sent after the update to finish")
    finally:
        answers = load.stop()

    # the lifecycle, per engine, as the engines themselves reported it
    log = world.call("update_log")
    prepared = {e[1]: (i, e[2], e[3]) for i, e in enumerate(log) if e[0] == "prepared"}
    paused = {e[1]: (i, e[2], e[3]) for i, e in enumerate(log) if e[0] == "paused"}
    ready = {e[1]: i for i, e in enumerate(log) if e[0] == "ready"}
    assert set(prepared) == set(paused) == set(ready) == set(urls), log
    for url in urls:
        assert prepared[url][1] == target, f"{url} had not staged v{target} when its pull returned: {log}"
        assert paused[url][1:] == (target, None), f"{url} at pause time (staged, paused_mode): {log}"
        assert prepared[url][0] < paused[url][0] < ready[url], log
    assert max(i for i, _, _ in prepared.values()) < min(i for i, _, _ in paused.values()), \
        f"an engine was paused before every engine had prepared: {log}"
    assert any(running >= 1 for _, _, running in prepared.values()), f"nothing was generating during the pulls: {log}"

    # every answer: served, with int versions in {before, target}, start <= end
    assert answers
    for answer in answers:
        if answer.status != 200:
            assert_retryable(answer)  # both engines activate at once: a short 503 is allowed
            continue
        start, end = served_versions(answer.body)
        assert type(start) is int and type(end) is int, answer.body["meta_info"]
        assert {start, end} <= {before, target} and start <= end, (start, end)
        if answer.sent_at > updated:
            assert (start, end) == (target, target), answer.body["meta_info"]
    assert any(a.status == 200 and served_versions(a.body) == (before, target) for a in answers), \
        "no request was in flight across an activation"

    assert world.call("versions") == [str(target)] * 2
    for key in ("perf/update_weights_prepare_time", "perf/update_weights_pause_time"):
        assert isinstance(metrics[key], float) and metrics[key] > 0, metrics
    assert world.version() == target


def test_router_constraints_through_the_managed_router(world):
    """min_version served; exact_version of a published but not yet activated version refused with a
    retryable 409 (never an older policy), then served once the manager has activated it."""
    current = world.version()
    for minimum in (0, current):
        ok = generate(world, weight_version={"min_version": minimum})
        assert ok.status_code == 200, ok.text
        assert served_versions(ok.json()) == (current, current)

    target = world.versions.publish_next(seed=2)  # published, not yet activated
    refused = generate(world, weight_version={"exact_version": target})
    assert refused.status_code == 409, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    body = refused.json()
    assert body["type"] == "WeightVersionNotReady" and body["retryable"] is True
    assert set(body["available_versions"]) == {current}

    metrics = world.call("update_weights", target)
    assert metrics["perf/update_weights_pause_time"] > 0
    served = generate(world, weight_version={"exact_version": target})
    assert served.status_code == 200, served.text
    assert served_versions(served.json()) == (target, target)
    older = generate(world, weight_version={"exact_version": current})
    assert older.status_code == 409, "an older policy was served for an exact constraint"


def test_killing_a_worker_under_load_answers_every_request(world):
    """20 long requests in flight, engine 0's process is SIGKILLed: each request ends with 200 or a
    retryable JSON error, none hangs past the client timeout."""
    version = world.version()
    urls = world.wait_all_ready(version)
    load = Load(world.router_url, concurrency=20, max_new_tokens=LONG_TOKENS, timeout_s=90.0, once=True)
    try:
        wait_until(lambda: running_requests(urls[0]) >= 4 and running_requests(urls[1]) >= 4, timeout=60,
                   what="requests in flight on both engines")
        pid = world.call("kill_engine", 0)
        assert pid
    finally:
        answers = load.stop()
    assert len(answers) == 20
    for answer in answers:
        assert answer.error is None, f"client-side failure (hang or broken connection): {answer.error}"
        if answer.status == 200:  # on engine 1, or on engine 0 if it finished before the kill
            assert served_versions(answer.body) == (version, version)
        else:
            assert_retryable(answer)
    failed = [a for a in answers if a.status == 502]
    assert failed and all(a.body["worker"] == urls[0] for a in failed), [a.body for a in answers if a.status != 200]
    assert any(a.status == 200 for a in answers)
    world.wait_all_ready(version)  # the monitor restarts it (the next test checks how)


def test_a_restarted_engine_is_routed_to_only_once_it_serves_the_current_version(world):
    """Kill engine 1 at version v >= 1; until the manager has restored it to v, every request (with
    ``min_version`` v or none) is served by engine 0 at v; then the router lists the new URL ready at v."""
    if world.version() == 0:
        world.publish_and_activate()
    version = world.version()
    old_urls = world.wait_all_ready(version)
    survivor, killed = old_urls[0], old_urls[1]
    events_before = len(world.call("info")["events"])

    world.call("kill_engine", 1)
    rounds: list[list[dict]] = []  # the served meta_info of each round of requests sent while restarting
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        workers = {w["url"]: w for w in world.router.list_workers()}
        new_url = world.engine_urls()[1]
        if new_url != killed and workers.get(new_url, {}).get("state") == "ready":
            break
        assert time.monotonic() < deadline, f"engine 1 not restored within {RESTART_TIMEOUT_S}s: {workers}"
        rounds.append([served_meta(world, extra) for extra in
                       ({"weight_version": {"min_version": version}}, {})])
    assert rounds, "the restart finished before any request could be sent"
    new_url = world.engine_urls()[1]
    for i, metas in enumerate(rounds):
        for meta in metas:
            assert (meta["weight_version_start"], meta["weight_version_end"]) == (version, version), meta
            # the last round may race the re-registration, which happens only once engine 1 is at v
            allowed = {survivor, new_url} if i == len(rounds) - 1 else {survivor}
            assert meta["routed_worker"] in allowed, f"routed to {meta['routed_worker']} while engine 1 restarts"

    new_url = world.engine_urls()[1]
    assert new_url != killed
    worker = world.router.wait_worker_version(new_url, version, timeout_s=10)
    assert worker["state"] == "ready"
    assert killed not in {w["url"] for w in world.router.list_workers()}
    assert world.call("versions") == [str(version)] * 2

    events = world.call("info")["events"][events_before:]
    kinds = [(e["engine"], e["event"]) for e in events]
    assert (1, "down") in kinds and (1, "restored") in kinds, events
    assert kinds.index((1, "down")) < kinds.index((1, "restored"))
    down = next(e for e in events if e["event"] == "down" and e["engine"] == 1)
    restored = next(e for e in events if e["event"] == "restored" and e["engine"] == 1)
    assert down["url"] == killed and restored["url"] == new_url and restored["version"] == version, events
    assert not [e for e in events if e["event"] == "recovery_failed"], events

    # the restored engine now takes requests again, at the current version
    wait_until(lambda: generate(world, weight_version={"exact_version": version}).json()["meta_info"]
               ["routed_worker"] == new_url, timeout=30, what="a request routed to the restored engine")


def test_an_update_while_an_engine_is_down_skips_it_and_the_restore_catches_up(world):
    """The training run does not stop for a dead engine: the update reaches the live one, and the
    restarted engine is brought to the newest version (base + chain) before it is routed to."""
    world.wait_all_ready(world.version())
    world.call("kill_engine", 0)
    version = world.publish_and_activate()  # engine 0 is dead (or restarting) right now
    assert world.call("versions")[1] == str(version)
    urls = world.wait_all_ready(version)
    assert world.call("versions") == [str(version)] * 2
    restored = [e for e in world.call("info")["events"] if e["event"] == "restored" and e["engine"] == 0]
    assert restored and restored[-1]["url"] == urls[0] and restored[-1]["version"] == version


def test_a_removed_engine_frees_its_gpu_for_a_managed_add(world, capsys):
    """``engines remove`` of engine 1 (on the run's placement group) stops it; ``engines add --managed 1``
    then starts an engine on its bundle (the cluster's one GPU outside the run stays free), caught up to
    the current version and routed to. (Last in the module: it changes the engine set.)"""
    import json

    import ray

    from miles_disagg.cli import main

    def engines(*argv: str) -> dict:
        capsys.readouterr()
        code = main(["engines", *argv, "--run-dir", str(world.run_dir), "--json"] if argv[0] == "list" else
                    ["engines", argv[0], "--run-dir", str(world.run_dir), "--json", *argv[1:]])
        out, err = capsys.readouterr()
        assert code == 0, err
        return json.loads(out)

    version = world.version()
    world.wait_all_ready(version)
    world.call("serve_membership")
    removed_url = world.engine_urls()[1]
    removed_gpus = next(e["gpu_ids"] for e in json.loads((world.run_dir / "placement.json").read_text())["engines"]
                        if e["address"] == removed_url)
    [removed] = engines("remove", removed_url)["removed"]
    assert removed["kind"] == "managed"
    free_before = ray.available_resources().get("GPU", 0)
    [joined] = engines("add", "--managed", "1")["joined"]
    assert (joined["kind"], joined["version"]) == ("managed", version)
    assert ray.available_resources().get("GPU", 0) == free_before == 1  # on the freed bundle, not the free GPU
    listed = {e["url"]: e for e in engines("list")["engines"]}
    assert listed[joined["url"]]["state"] == "ready" and removed_url not in listed
    placed = json.loads((world.run_dir / "placement.json").read_text())["engines"]
    assert next(e["gpu_ids"] for e in placed if e["address"] == joined["url"]) == removed_gpus
    assert world.call("versions") == [str(version)] * 2
