"""The router's generation fast path (:mod:`miles_disagg.router.fast_path`): generation requests skip
FastAPI's routing but keep every contract of the guard and of the routes (keys, size limit, server id,
methods, the proxy's answers); everything else still goes through the app."""

from __future__ import annotations

import contextlib

import httpx

from miles_disagg.net.asgi_guard import SERVER_ID_HEADER, ServerGuard
from miles_disagg.net.auth import ApiKeys
from miles_disagg.router.app import create_app
from miles_disagg.router.config import RouterConfig
from miles_disagg.router.fast_path import GenerationFastPath
from router_fixtures import FakeWorker, fake_worker_app, serve_in_thread

KEYS = ApiKeys(api_key="fast-path-user-key", admin_api_key="fast-path-admin-key")
USER = {"Authorization": f"Bearer {KEYS.api_key}"}


@contextlib.contextmanager
def guarded_router(worker_url: str, max_request_bytes: int = 4096):
    app = create_app(RouterConfig(workers=(worker_url,), health_check_interval_s=0.2),
                     guard=ServerGuard(KEYS, max_request_bytes=max_request_bytes))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        yield app, http


def test_generation_through_the_fast_path_keeps_the_guard_and_the_route_contracts():
    fake = FakeWorker(weight_version="3")
    with serve_in_thread(fake_worker_app(fake)) as worker_url, guarded_router(worker_url) as (app, http):
        body = {"input_ids": [1, 2], "weight_version": {"min_version": 3}}
        assert http.post("/generate", json=body).status_code == 401  # no key: the guard still answers first
        served = http.post("/generate", json=body, headers=USER)
        assert served.status_code == 200, served.text
        assert served.headers[SERVER_ID_HEADER] == app.state.server_id
        assert served.headers["x-routed-worker"] == worker_url
        assert served.json()["meta_info"]["weight_version_start"] == 3
        assert fake.received[-1] == ("/generate", {"input_ids": [1, 2]})  # the constraint was stripped
        assert http.put("/generate", json={"input_ids": [1]}, headers=USER).status_code == 200
        assert http.get("/generate", headers=USER).status_code == 405  # other methods: the app's answer
        assert http.put("/v1/completions", json={}, headers=USER).status_code == 405
        too_big = http.post("/generate", content=b"x" * 5000, headers={**USER, "content-type": "application/json"})
        assert too_big.status_code == 413
        bad = http.post("/generate", content=b"{not json", headers={**USER, "content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["type"] == "InvalidInput"
        refused = http.post("/generate", json={"input_ids": [1], "weight_version": {"exact_version": 9}},
                            headers=USER)
        assert refused.status_code == 409 and refused.json()["available_versions"] == [3]
        assert http.get("/metrics", headers=USER).json()["requests"] == 4  # served 2, bad JSON, refused: what reached the proxy
        assert http.get("/health").status_code == 200  # other paths: the app
        assert isinstance(app.fast_path, GenerationFastPath)  # and the fast path was the one used
