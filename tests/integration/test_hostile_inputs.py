"""Issue 30, item 7, through real HTTP: hostile inputs that used to get through.

A built-in engine process (the default 32 MiB limit and body floor) and in-process router and
gateway (a 1 MiB limit, a short body grace so a trickle is cut off in a test's time). Each test
plays the attacker on a raw socket or with a plain client, then checks nothing changed.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from router_fixtures import serve_in_thread
from miles_disagg.net.asgi_guard import SERVER_ID_HEADER, ServerGuard
from miles_disagg.engines.launch import launch_engine
from miles_disagg.router.app import create_app
from miles_disagg.router.config import RouterConfig
from miles_disagg.service.gateway import GatewayConfig, create_gateway_app

pytestmark = pytest.mark.timeout(300)
SMALL_LIMIT = 1 << 20
GUARD = ServerGuard(max_request_bytes=SMALL_LIMIT, body_grace_s=1.0, min_body_bytes_per_s=1024)
GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hostile")
    launched = launch_engine(tiny_qwen3_dir, log_path=root / "engine.log",
                             extra_args=["--weight-store-dir", str(root / "store"),
                                         "--local-checkpoint-dir", str(root / "local")])
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def router(engine):
    with serve_in_thread(create_app(RouterConfig(workers=(engine.url,), health_check_interval_s=0.2), guard=GUARD)
                         ) as url:
        yield url


@pytest.fixture(scope="module")
def gateway():
    config = GatewayConfig(router=RouterConfig(health_check_interval_s=0.2), expire_interval_s=0.05)
    with serve_in_thread(create_gateway_app(config, guard=GUARD)) as url:
        yield url


def raw(url: str, head: str, body: bytes = b"", timeout_s: float = 30.0) -> tuple[bytes, float]:
    """Send ``head`` (and ``body``) on a fresh connection; the whole answer (its head, and its body
    as long as ``Content-Length`` says) and how long it took."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        started = time.monotonic()
        sock.sendall(head.encode() + body)
        answer = read_answer(sock)
        return answer, time.monotonic() - started


def read_answer(sock: socket.socket) -> bytes:
    """Read until the answer's head is complete, then until its declared body has come (or the
    server closed the connection). One ``recv`` is not an answer: a server sends the head and
    the body in separate writes, and the body may arrive after the head."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        if not chunk:
            return answer
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lengths = [line.split(b":", 1)[1] for line in head.split(b"\r\n")[1:] if line.lower().startswith(b"content-length:")]
    length = int(lengths[0]) if lengths else None
    while length is None or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def declared(length: int) -> str:
    return f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"


@pytest.mark.parametrize("server", ["engine", "router", "gateway"])
def test_a_declared_length_over_the_limit_is_413_at_once_without_the_body(server, request) -> None:
    url = request.getfixturevalue(server)
    url = url if isinstance(url, str) else url.url
    answer, _ = raw(url, declared(1 << 40), timeout_s=15.0)  # a body that never comes (it used to hold 20 s)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"RequestTooLarge" in answer
    assert httpx.get(url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize("server", ["router", "gateway"])
def test_a_body_trickling_below_the_floor_is_cut_off_with_408(server, request) -> None:
    url = request.getfixturevalue(server)
    answer, _ = raw(url, declared(100_000), b'{"input_ids": [', timeout_s=30.0)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"too slow" in answer


def test_an_honest_oversized_sender_still_reads_its_413(router) -> None:
    answer = httpx.post(router + "/generate", content=b"x" * (3 * SMALL_LIMIT), timeout=60)
    assert answer.status_code == 413 and answer.json()["type"] == "RequestTooLarge"


def test_nul_bytes_in_path_fields_and_a_string_target_version_are_400(engine, tmp_path: Path) -> None:
    before = httpx.get(engine.url + "/model_info", timeout=30).json()["weight_version"]
    bodies = [("/pull_weights", {"target_version": 1, "source_dir": "/tmp/store\x00/x"}),
              ("/pull_weights", {"target_version": 1, "source_dir": str(tmp_path), "local_checkpoint_dir": "a\x00"}),
              ("/update_weights_from_disk", {"model_path": str(tmp_path) + "\x00", "weight_version": "1"}),
              ("/pull_weights", {"target_version": "1", "source_dir": str(tmp_path)})]
    for path, body in bodies:
        answer = httpx.post(engine.url + path, json=body, timeout=30)
        assert answer.status_code == 400, (path, body, answer.text)
        assert "NUL" in answer.text or "target_version" in answer.text
    assert httpx.get(engine.url + "/model_info", timeout=30).json()["weight_version"] == before


def test_a_version_constraint_sent_to_the_engine_is_400_and_through_the_router_it_is_honoured(engine, router) -> None:
    direct = httpx.post(engine.url + "/generate", json={**GENERATE, "weight_version": {"min_version": 0}}, timeout=60)
    assert direct.status_code == 400 and "router" in direct.text
    routed = httpx.post(router + "/generate", json={**GENERATE, "weight_version": {"min_version": 0}}, timeout=60)
    assert routed.status_code == 200, routed.text
    assert routed.json()["meta_info"]["weight_version_start"] == 0


@pytest.mark.parametrize("server", ["router", "gateway"])
def test_the_router_refuses_itself_and_its_aliases_as_a_worker(server, request) -> None:
    url = request.getfixturevalue(server)
    port = url.rsplit(":", 1)[1]
    before = httpx.get(url + "/list_workers", timeout=30).json()["urls"]
    for alias in (url, f"http://localhost:{port}", f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/"):
        answer = httpx.post(url + "/add_worker", json={"url": alias}, timeout=30)
        assert answer.status_code == 400 and "itself" in answer.json()["message"], (alias, answer.text)
    answer = httpx.post(url + "/add_worker", json={"url": "http://a\x00b:1"}, timeout=30)
    assert answer.status_code == 400
    assert httpx.get(url + "/list_workers", timeout=30).json()["urls"] == before
    assert httpx.get(url + "/health", timeout=30).headers[SERVER_ID_HEADER]
