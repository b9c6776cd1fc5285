"""Helpers and fixtures for driving an engine over HTTP exactly as a SGLang client does.

Set ``MILES_DISAGG_ENGINE_URL=http://host:port`` to run the contract tests against any
server that speaks SGLang's API (a real SGLang server included); otherwise each module
starts the built-in engine (``python -m miles_disagg.engines.builtin``) on a free port with the
tiny Qwen3. Tests that need the built-in engine's own features skip against a foreign
server with a reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from miles_disagg.engines.launch import LaunchedEngine, free_port, launch_engine

ENGINE_URL_ENV = "MILES_DISAGG_ENGINE_URL"
STARTUP_TIMEOUT_S = 180.0
LONG_TOKENS = 1500  # long enough to still be running while a test pauses/updates


@dataclass
class EngineHandle:
    url: str
    builtin: bool
    model_dir: Path | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=120.0)

    def require_builtin(self, why: str) -> None:
        if not self.builtin:
            pytest.skip(f"needs the built-in engine ({why}); {ENGINE_URL_ENV} points at another server")

    def post(self, path: str, body: Any = None, **kwargs) -> httpx.Response:
        return self.client.post(path, json=body if body is not None else {}, **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.client.get(path, **kwargs)

    def generate(self, body: dict) -> Any:
        response = self.post("/generate", body)
        assert response.status_code == 200, response.text
        return response.json()

    def version(self) -> str:
        return self.get("/get_weight_version").json()["weight_version"]

    def internal_state(self) -> dict:
        return self.get("/get_server_info").json()["internal_states"][0]

    def logs(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""


def start_engine(model_dir: Path, log_dir: Path, *extra: str) -> EngineHandle:
    """Start ``python -m miles_disagg.engines.builtin`` on a free port and wait for ``/health``."""
    port = free_port()
    launched = launch_engine(model_dir, log_path=log_dir / f"engine-{port}.log", port=port, extra_args=extra,
                             startup_timeout_s=STARTUP_TIMEOUT_S)
    return EngineHandle(url=launched.url, builtin=True, model_dir=model_dir, proc=launched.proc,
                        log_path=launched.log_path)


def stop_engine(handle: EngineHandle) -> None:
    handle.client.close()
    if handle.proc is not None:
        LaunchedEngine(handle.url, handle.proc, handle.log_path or Path(os.devnull)).stop()


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The engine under test: the server at ``$MILES_DISAGG_ENGINE_URL`` or a fresh built-in one."""
    url = os.environ.get(ENGINE_URL_ENV)
    if url:
        handle = EngineHandle(url=url.rstrip("/"), builtin=False)
        yield handle
        handle.client.close()
        return
    # SGLang's API as SGLang behaves: relabelling allowed (the built-in engine refuses it by default)
    handle = start_engine(tiny_qwen3_dir, tmp_path_factory.mktemp("engine-logs"), "--allow-unverified-versions")
    yield handle
    stop_engine(handle)


@contextlib.contextmanager
def inprocess_engine(model_dir: Path, **config) -> Iterator[tuple[Any, EngineHandle]]:
    """The built-in engine in this process behind a real HTTP server (tests inject faults)."""
    import uvicorn

    from miles_disagg.engines.builtin.runtime import Engine, EngineConfig
    from miles_disagg.engines.builtin.server import create_app

    engine = Engine(EngineConfig(model_path=model_dir, **config))
    engine.start()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=free_port(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    handle = EngineHandle(url=f"http://127.0.0.1:{server.config.port}", builtin=True)
    try:
        wait_until(lambda: server.started, what="in-process server")
        yield engine, handle
    finally:
        server.should_exit = True
        thread.join(10)
        handle.client.close()
        engine.stop()


# --------------------------------------------------------------------------- concurrency helpers


class Background:
    """Run a blocking call on a thread; ``result()`` re-raises its exception."""

    def __init__(self, fn: Callable[[], Any]):
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as exc:  # surfaced by result()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 120.0) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("background call did not finish")
        if self._error is not None:
            raise self._error
        return self._result


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``predicate`` (state, not time) until true; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def long_request(engine: EngineHandle, rid: str, max_new_tokens: int = LONG_TOKENS, **extra) -> Background:
    """A generation that runs long enough to be caught in flight."""
    body = {
        "input_ids": [5, 6, 7, 8], "rid": rid, "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True,
                            "sampling_seed": 1},
        **extra,
    }
    return Background(lambda: engine.generate(body))


def wait_in_flight(engine: EngineHandle, requests: list[Background], count: int | None = None) -> None:
    """Return once ``count`` (default: all) of ``requests`` are decoding on the server.

    Exact on the built-in engine (its running-request count); on another server, whose
    server info has no such count, it gives the requests a second to be admitted and
    checks that none has finished yet.
    """
    count = len(requests) if count is None else count
    if engine.builtin:
        wait_until(lambda: running_count(engine) >= count, what=f"{count} requests in flight")
    else:
        time.sleep(1.0)
    assert not any(r.done() for r in requests), "a long request finished before the test could act"


def running_count(engine: EngineHandle) -> int:
    """Requests decoding now (built-in engine: exact; other servers: best effort via server info)."""
    info = engine.get("/get_server_info").json()
    states = info.get("internal_states") or [{}]
    return int(states[0].get("num_running_requests", states[0].get("num_running_reqs", 0)) or 0)


def sse_events(response: httpx.Response) -> list[Any]:
    """Parse ``data: ...`` lines of an SSE body (``[DONE]`` kept as the string)."""
    events = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def greedy_reference(model_dir: Path, tensors: dict, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation computed with plain transformers forward passes over ``tensors``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(tensors, strict=False)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
