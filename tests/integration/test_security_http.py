"""Issue 14 through the real HTTP interfaces: a stranger on the network steers nothing.

One built-in engine process (keys from the environment, store and local-checkpoint roots), an
agent process in front of it (keys as flags), and in-process router, gateway and replica control
API, each with keys. Every test plays one finding of the issue and then checks what must hold
whatever the attacker sent: ``/health`` still answers, the served version is unchanged, and no
file was created or deleted outside the servers' roots.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi import Request  # module level: handlers' string annotations resolve against globals

from engine_fixtures import wait_until
from router_fixtures import FakeWorker, fake_worker_app, generate_body, serve_in_thread
from miles_disagg.net.asgi_guard import ServerGuard
from miles_disagg.net.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, ApiKeys
from miles_disagg.engines.client import EngineClient
from miles_disagg.engines.launch import launch_agent, launch_engine
from miles_disagg.router.app import create_app
from miles_disagg.router.config import RouterConfig
from miles_disagg.service.gateway import GatewayConfig, create_gateway_app
from miles_disagg.service.protocol import ReplicaState, ReplicaStatus
from miles_disagg.service.replica import control_app

pytestmark = pytest.mark.timeout(300)

USER, ADMIN = "user-key-0123", "admin-key-4567"
KEYS = ApiKeys(USER, ADMIN)
AS_USER, AS_ADMIN = {"Authorization": f"Bearer {USER}"}, {"Authorization": f"Bearer {ADMIN}"}
SMALL_LIMIT = 1 << 20  # the in-process servers' --max-request-bytes
ADMIN_POSTS = ["/update_weights_from_disk", "/pull_weights", "/update_weight_version", "/pause_generation",
               "/continue_generation", "/abort_request", "/init_weights_update_group", "/flush_cache",
               "/activate_weights"]


def snapshot(root: Path) -> dict[str, int]:
    """Every file and directory under ``root`` (logs excluded: servers write them) with its size."""
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1)
            for p in sorted(root.rglob("*")) if not p.name.endswith(".log")}


class World:
    """The servers under attack and the directories they may and may not touch."""

    def __init__(self, root: Path, base: Path):
        from miles_disagg.weights.publisher import DeltaPublisher

        self.root = root
        self.model = root / "model"
        shutil.copytree(base, self.model)
        self.store, self.local = root / "store", root / "host" / "ckpt"
        self.local.parent.mkdir(parents=True)
        (root / "agent-host").mkdir()
        self.outside = root / "outside"  # an attacker's directory with a checkpoint and a precious file
        shutil.copytree(base, self.outside / "ckpt")
        (self.outside / "target.slots").mkdir()
        (self.outside / "target.slots" / "precious").write_text("keep me")
        from safetensors.torch import load_file

        publisher = DeltaPublisher(self.store, base_dir=self.model)
        publisher.capture_baseline()
        tensors = load_file(str(next(self.model.glob("*.safetensors"))))
        self.v1 = publisher.publish([("lm_head.weight", tensors["lm_head.weight"] + 0.5)]).ref.version
        publisher.close()
        env = {**os.environ, API_KEY_ENV: USER, ADMIN_API_KEY_ENV: ADMIN}  # the engine reads its keys from here
        with _environ(env):
            self.engine = launch_engine(self.model, log_path=root / "engine.log", extra_args=[
                "--weight-store-dir", str(self.store), "--local-checkpoint-dir", str(self.local)])
        self.agent = launch_agent(self.engine.url, root / "agent-host" / "ckpt", log_path=root / "agent.log",
                                  base_dir=self.model, store_dirs=[self.store],
                                  extra_args=["--api-key", USER, "--admin-api-key", ADMIN,
                                              "--max-request-bytes", str(SMALL_LIMIT)])
        self.client = EngineClient(self.engine.url, store_dir=self.store, local_checkpoint_dir=self.local, keys=KEYS)

    def close(self) -> None:
        self.client.close()
        self.agent.stop()
        self.engine.stop()

    def version(self) -> str:
        return self.client.weight_version()

    def activate(self, version: int) -> None:
        """Pull and activate ``version`` with the admin key."""
        self.client.pull(version)
        self.client.pause("retract")
        try:
            self.client.load(version)
        finally:
            self.client.resume()

    def healthy(self) -> bool:
        return httpx.get(f"{self.engine.url}/health", timeout=30).status_code == 200


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def world(tiny_qwen3_dir, tmp_path_factory):
    w = World(tmp_path_factory.mktemp("security"), tiny_qwen3_dir)
    yield w
    w.close()


@contextlib.contextmanager
def unchanged(world: World):
    """The invariants of every test: health, served version and files outside the roots."""
    version, files = world.version(), snapshot(world.root)
    yield
    assert world.healthy(), "the engine stopped answering /health"
    assert world.version() == version, "the served version changed"
    after = snapshot(world.root)
    changed = {k for k in files.keys() | after.keys() if files.get(k) != after.get(k)}
    inside = [str(world.local.relative_to(world.root)), str(world.store.relative_to(world.root)), "agent-host"]
    assert [k for k in changed if not any(k.startswith(r) for r in inside)] == []


@contextlib.contextmanager
def router_with_keys(*workers: str, limit: int = SMALL_LIMIT):
    guard = ServerGuard(KEYS, limit)
    app = create_app(RouterConfig(workers=workers, health_check_interval_s=0.2, retry_after_s=0.2), guard=guard)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        yield http


@contextlib.contextmanager
def gateway_with_keys(limit: int = SMALL_LIMIT):
    config = GatewayConfig(router=RouterConfig(health_check_interval_s=0.2, retry_after_s=0.2), expire_interval_s=0.05)
    with serve_in_thread(create_gateway_app(config, ServerGuard(KEYS, limit))) as url, \
            httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        yield http


# --------------------------------------------------------------------------- 1. keys


def test_every_engine_and_agent_endpoint_but_health_needs_its_key(world):
    with unchanged(world):
        for url in (world.engine.url, world.agent.url):
            for path in ADMIN_POSTS:
                for headers in ({}, AS_USER, {"Authorization": "Bearer wrong"}):
                    refused = httpx.post(f"{url}{path}", json={"mode": "abort"}, headers=headers, timeout=30)
                    assert refused.status_code == 401, (url, path, headers, refused.text)
                    assert refused.json()["error"]["type"] == "Unauthorized"
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
            assert httpx.post(f"{url}/generate", json=body, timeout=30).status_code == 401
            assert httpx.post(f"{url}/generate", json=body, headers=AS_USER, timeout=60).status_code == 200
            assert httpx.get(f"{url}/get_server_info", timeout=30).status_code == 401
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # open to probes
        assert httpx.get(f"{world.agent.url}/agent_health", timeout=30).status_code == 200


def test_the_agent_never_lends_its_admin_key_to_a_caller_without_it(world, tmp_path):
    """An agent with only an admin key leaves ordinary paths open (as SGLang does); what it
    forwards for them carries no key, so no open path borrows the admin key upstream."""
    from fastapi import FastAPI

    from miles_disagg.engines.agent.app import create_app as agent_app
    from miles_disagg.engines.agent.state import Agent, AgentConfig

    seen: list[tuple[str, str | None]] = []
    upstream = FastAPI()

    @upstream.api_route("/{path:path}", methods=["GET", "POST"])
    async def record(request: Request, path: str):
        seen.append((request.url.path, request.headers.get("authorization")))
        return {"weight_version": "0"}

    with unchanged(world), serve_in_thread(upstream) as engine_url:
        agent = Agent(AgentConfig(engine_url=engine_url, local_checkpoint_dir=tmp_path / "ckpt", base_dir=world.model,
                                  guard=ServerGuard(ApiKeys(None, ADMIN))))
        with serve_in_thread(agent_app(agent)) as url:
            assert httpx.post(f"{url}/some_sglang_admin_path", json={}, timeout=30).status_code == 200
            assert httpx.post(f"{url}/pause_generation", json={}, timeout=30).status_code == 401
            assert httpx.post(f"{url}/pause_generation", json={}, headers=AS_ADMIN, timeout=30).status_code == 200
    assert seen == [("/some_sglang_admin_path", None), ("/pause_generation", f"Bearer {ADMIN}")]


# --------------------------------------------------------------------------- 2. confinement and labels


def test_an_unpublished_checkpoint_is_never_loaded_or_labelled(world):
    with unchanged(world), router_with_keys(world.engine.url) as router:
        for body in ({"model_path": str(world.outside / "ckpt"), "weight_version": "77"},
                     {"model_path": str(world.model), "weight_version": "77"},
                     {"model_path": str(world.local.parent), "weight_version": "77"}):
            for url in (world.engine.url, world.agent.url):
                refused = httpx.post(f"{url}/update_weights_from_disk", json=body, headers=AS_ADMIN, timeout=60)
                # outside the roots: 403; the base or the local checkpoint under a label they do not hold:
                # 403 (engine) or 400 (the agent: "version 77 is not prepared on this host")
                assert refused.status_code in (400, 403), (url, body, refused.text)
                assert refused.status_code == 403 or "outside" not in body["model_path"]
        relabel = httpx.post(f"{world.engine.url}/update_weight_version", json={"new_version": "77"},
                             headers=AS_ADMIN, timeout=30)
        assert relabel.status_code == 403 and "verified" in relabel.json()["message"]
        outside = httpx.post(f"{world.engine.url}/update_weights_from_disk", headers=AS_ADMIN, timeout=60,
                             json={"model_path": str(world.outside / "ckpt")})
        assert str(world.store) in outside.json()["message"]  # the message names the allowed roots
        never = router.post("/generate", json=generate_body(weight_version={"exact_version": 77}), headers=AS_USER)
        assert never.status_code == 409 and never.json()["type"] == "WeightVersionNotReady"


def test_a_pull_writes_only_under_the_local_checkpoint_and_reads_only_the_store(world):
    with unchanged(world):
        for body in ({"target_version": world.v1, "source_dir": str(world.store),
                      "local_checkpoint_dir": str(world.outside / "target")},
                     {"target_version": world.v1, "source_dir": str(world.outside)}):
            for url in (world.engine.url, world.agent.url):
                refused = httpx.post(f"{url}/pull_weights", json=body, headers=AS_ADMIN, timeout=60)
                assert refused.status_code == 403, (url, body, refused.text)
        assert (world.outside / "target.slots" / "precious").read_text() == "keep me"
        assert not (world.outside / "target").exists()


def test_a_verified_pull_and_activation_still_work_with_keys(world):
    """The admin key does what the stranger could not: pull, activate, and the label follows."""
    world.activate(world.v1)
    assert world.version() == str(world.v1)
    assert world.client.post("/update_weight_version", {"new_version": str(world.v1)})["success"]  # a no-op


# --------------------------------------------------------------------------- 3. registries


def test_routers_register_nobody_without_the_admin_key_and_learn_versions_from_workers(world):
    liar = FakeWorker(weight_version="999")
    with unchanged(world), serve_in_thread(fake_worker_app(liar)) as fake_url, \
            router_with_keys(world.engine.url) as router:
        wait_until(lambda: router.get("/list_workers", headers=AS_USER).json()["workers"][0]["state"] == "ready",
                   what="the engine ready in the router")
        for path, body in (("/add_worker", {"url": fake_url}), ("/remove_worker", {"url": world.engine.url}),
                           ("/set_worker_state", {"url": world.engine.url, "state": "paused"})):
            for headers in ({}, AS_USER):
                assert router.post(path, json=body, headers=headers).status_code == 401, (path, headers)
        claimed = router.post("/set_worker_state", headers=AS_ADMIN,
                              json={"url": world.engine.url, "state": "ready", "weight_version": 999})
        assert claimed.status_code == 409 and claimed.json()["actual"] == int(world.version())
        [worker] = router.get("/list_workers", headers=AS_USER).json()["workers"]
        assert (worker["url"], worker["weight_version"]) == (world.engine.url, int(world.version()))
        assert router.post("/generate", json=generate_body(weight_version={"exact_version": 999}),
                           headers=AS_USER).status_code == 409
        assert liar.received == []  # the fake worker never saw a request


def test_the_gateway_takes_heartbeats_only_with_the_admin_key_and_versions_only_from_engines(world):
    status = ReplicaStatus(replica_id="r0", incarnation="i", seq=1, engine_url=world.engine.url, control_url=None,
                           state=ReplicaState.READY, weight_version=999, run_id="run-a")
    with unchanged(world), gateway_with_keys() as gateway:
        for path, body in (("/heartbeat", status.to_json()), ("/deregister", {"replica_id": "r0"}), ("/wake", {})):
            for headers in ({}, AS_USER):
                assert gateway.post(path, json=body, headers=headers).status_code == 401, (path, headers)
        assert gateway.get("/replicas", headers=AS_USER).json()["replicas"] == []
        beat = gateway.post("/heartbeat", json=status.to_json(), headers=AS_ADMIN)
        assert beat.status_code == 200 and beat.json()["worker"]["state"] == "paused"  # the engine says otherwise
        refused = gateway.post("/generate", json=generate_body(weight_version={"exact_version": 999}),
                               headers=AS_USER)
        assert refused.status_code in (409, 503) and refused.json()["retryable"] is True


def test_a_replica_serving_another_runs_version_never_answers_a_run_bound_request(world):
    """A wiped and reused store: the new run's v1 is not the old run's v1, whatever the number."""
    if world.version() != str(world.v1):
        world.activate(world.v1)  # (v0, the base, is every run's)
    served = int(world.version())
    old_run = ReplicaStatus(replica_id="r1", incarnation="i", seq=1, engine_url=world.engine.url, control_url=None,
                            state=ReplicaState.READY, weight_version=served, run_id="old-run")
    with unchanged(world), gateway_with_keys() as gateway:
        assert gateway.post("/heartbeat", json=old_run.to_json(), headers=AS_ADMIN).status_code == 200
        new_run = generate_body(weight_version={"exact_version": served, "run_id": "new-run"})
        assert gateway.post("/generate", json=new_run, headers=AS_USER).status_code == 409
        same_run = generate_body(weight_version={"exact_version": served, "run_id": "old-run"})
        answer = gateway.post("/generate", json=same_run, headers=AS_USER)
        assert answer.status_code == 200 and answer.json()["meta_info"]["weight_version_start"] == served
        moved = replace(old_run, seq=2, run_id="new-run")
        assert gateway.post("/heartbeat", json=moved.to_json(), headers=AS_ADMIN).status_code == 200
        assert gateway.post("/generate", json=new_run, headers=AS_USER).status_code == 200


def test_a_replica_control_api_drains_only_with_the_admin_key(world):
    calls: list[str] = []
    replica = SimpleNamespace(guard=ServerGuard(KEYS), stop=lambda: calls.append("drain"),
                              wake=lambda: calls.append("wake"), status=lambda: SimpleNamespace(to_json=dict))
    with unchanged(world), serve_in_thread(control_app(replica)) as url:
        for path in ("/drain", "/wake"):
            for headers in ({}, AS_USER):
                assert httpx.post(f"{url}{path}", headers=headers, timeout=30).status_code == 401
        assert calls == []
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert httpx.post(f"{url}/wake", headers=AS_ADMIN, timeout=30).status_code == 200 and calls == ["wake"]


# --------------------------------------------------------------------------- 4. hostile bodies


def _chunks(total: int, size: int = 1 << 16):
    for _ in range(total // size):
        yield b"[" * size


def test_oversized_bodies_are_413_before_they_are_read(world):
    big = 40 << 20  # over the engine's default 32 MiB
    with unchanged(world), router_with_keys(world.engine.url) as router, gateway_with_keys() as gateway:
        declared = httpx.post(f"{world.engine.url}/generate", content=b" " * big, headers=AS_USER, timeout=120)
        assert declared.status_code == 413 and "max-request-bytes" in declared.json()["message"]
        streamed = httpx.post(f"{world.engine.url}/generate", content=_chunks(big), headers=AS_USER, timeout=120)
        assert streamed.status_code == 413
        for client, base in ((router, ""), (gateway, ""), (httpx.Client(base_url=world.agent.url, timeout=60), "")):
            for content in (b" " * (2 * SMALL_LIMIT), _chunks(2 * SMALL_LIMIT)):
                answer = client.post(f"{base}/generate", content=content, headers=AS_USER)
                assert answer.status_code == 413, answer.text
        long_text = {"text": "1" * 4_000_000, "sampling_params": {"max_new_tokens": 1}}  # under the limit
        refused = httpx.post(f"{world.engine.url}/generate", json=long_text, headers=AS_USER, timeout=60)
        assert refused.status_code == 400 and "cannot fit the model's context" in refused.json()["error"]["message"]


HOSTILE = {
    "lone surrogate": b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 1}}',
    "deep nesting": b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "invalid utf-8": b'{"text": "\xff\xfe"}',
    "wrong types": b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}}',
    "not an object": b"[1, 2]",
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_json_is_a_non_retryable_400_on_every_server(world, case):
    with unchanged(world), router_with_keys(world.engine.url) as router, gateway_with_keys() as gateway:
        status = ReplicaStatus(replica_id="r2", incarnation="i", seq=1, engine_url=world.engine.url,
                               control_url=None, state=ReplicaState.READY, weight_version=int(world.version()))
        assert gateway.post("/heartbeat", json=status.to_json(), headers=AS_ADMIN).status_code == 200
        clients = {"engine": httpx.Client(base_url=world.engine.url, timeout=60), "router": router,
                   "gateway": gateway, "agent": httpx.Client(base_url=world.agent.url, timeout=60)}
        headers = {**AS_USER, "content-type": "application/json"}
        for name, client in clients.items():
            answer = client.post("/generate", content=HOSTILE[case], headers=headers)
            assert answer.status_code == 400, (name, answer.status_code, answer.text)
            body = answer.json()
            message = body.get("message") or body["error"]["message"]
            assert message and body.get("retryable", body.get("error", {}).get("retryable")) is False, (name, body)
        for name in ("engine", "agent"):
            clients[name].close()
