"""Helpers for router tests: an in-process router, a fake worker, request bodies.

The router runs in this process behind a real uvicorn server on 127.0.0.1 (so a test
can start one per test in milliseconds); engines are real built-in engine processes
(``engine_fixtures``). The fake worker is a tiny SGLang-shaped server whose answers a
test controls, for paths the built-in engine does not serve (OpenAI routes) and for
faults it cannot be made to produce on demand.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx
from fastapi import Request  # module level: handlers' string annotations resolve against globals

from engine_fixtures import wait_until
from miles_disagg.engines.launch import free_port
from miles_disagg.router.app import create_app
from miles_disagg.router.config import RouterConfig
from miles_disagg.router.client import RouterClient


def generate_body(max_new_tokens: int = 4, **extra: Any) -> dict:
    return {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                                        "ignore_eos": True}, **extra}


@contextlib.contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Run an ASGI app on a free 127.0.0.1 port in a daemon thread; yields its URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), what="in-process server")
        assert server.started, "in-process server failed to start"
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


@dataclass
class RouterUnderTest:
    """An in-process router: its URL, a registry client, an HTTP client for generation."""

    url: str
    client: RouterClient
    http: httpx.Client

    def generate(self, body: dict, **kwargs) -> httpx.Response:
        return self.http.post("/generate", json=body, **kwargs)

    def served(self) -> dict[str, int]:
        return {w["url"]: w["num_served"] for w in self.client.list_workers()}


@contextlib.contextmanager
def inprocess_router(**config: Any) -> Iterator[RouterUnderTest]:
    """``create_app(RouterConfig(**config))`` served on a free port (short health interval by default)."""
    config.setdefault("health_check_interval_s", 0.2)
    config.setdefault("retry_after_s", 0.2)
    with serve_in_thread(create_app(RouterConfig(**config))) as url:
        handle = RouterUnderTest(url, RouterClient(url), httpx.Client(base_url=url, timeout=120.0, trust_env=False))
        try:
            yield handle
        finally:
            handle.client.close()
            handle.http.close()


@dataclass
class FakeWorker:
    """What the fake worker answers; a test mutates these fields between requests."""

    weight_version: Any = "default"
    generate_status: int = 200
    received: list[tuple[str, dict]] = field(default_factory=list)


def fake_worker_app(fake: FakeWorker):
    """A minimal SGLang-shaped server: ``/health``, ``/model_info`` (its weight_version), echoing generation routes."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.get("/model_info")
    async def model_info():
        return {"weight_version": fake.weight_version}

    async def echo(request: Request):
        body = await request.json()
        fake.received.append((request.url.path, body))
        if fake.generate_status != 200:
            return JSONResponse({"error": {"message": "injected fault"}}, status_code=fake.generate_status)
        if request.url.path == "/generate":
            return {"text": "x", "output_ids": [1], "meta_info": {"weight_version": fake.weight_version}}
        return {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "x"}]}

    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.post(path)(echo)
    return app


def retry_until_served(router: RouterUnderTest, body: dict, timeout_s: float = 20.0) -> httpx.Response:
    """POST ``/generate`` until it is not a retryable refusal (as a rollout client does)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = router.generate(body)
        if response.status_code not in (409, 503) or time.monotonic() > deadline:
            return response
        assert response.json()["retryable"] is True
        time.sleep(0.05)
