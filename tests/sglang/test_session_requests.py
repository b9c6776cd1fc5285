"""What the router sends for a session's turn, judged by SGLang's own request type: a keyed ``/generate``
carries the served version's cache namespace in ``extra_key`` (miles' ``weight-version:N``), which keeps
SGLang's radix cache from reusing KV of another policy version for it; an unkeyed one carries none."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def _router(worker_url: str):
    import socket

    import uvicorn

    from miles_disagg.router.app import create_app
    from miles_disagg.router.config import RouterConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(RouterConfig(workers=(worker_url,), health_check_interval_s=0.2)),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the router did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_sessions_generate_reaches_sglang_with_the_served_versions_cache_namespace(sglang, manager, io_struct):
    manager.version = "5"
    try:
        with _router(sglang.url) as url:
            body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
            deadline = time.monotonic() + 30
            while (answer := httpx.post(f"{url}/generate", json=body, headers={"X-SMG-Routing-Key": "s1"})).status_code != 200:
                assert answer.status_code == 503 and time.monotonic() < deadline, answer.text  # until the probe ran
                time.sleep(0.1)
            assert httpx.post(f"{url}/generate", json=body).status_code == 200
    finally:
        manager.version = "0"
    keyed, unkeyed = [r for r in manager.of_type("GenerateReqInput") if r.input_ids == [3, 4, 5]][-2:]  # not probes
    assert isinstance(keyed, io_struct.GenerateReqInput)
    assert keyed.extra_key == "weight-version:5" and unkeyed.extra_key is None
