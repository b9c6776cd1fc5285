"""Session affinity through a real router over HTTP (fake SGLang-shaped workers): each session's turns
stay on one worker, a keyed ``/generate`` carries the served version's cache namespace (SGLang's
``extra_key``), and when a worker dies its sessions move to the others and finish, each move counted."""

from __future__ import annotations

import contextlib

import pytest

from router_fixtures import FakeWorker, fake_worker_app, inprocess_router, serve_in_thread

pytestmark = pytest.mark.timeout(120)
KEY = "X-SMG-Routing-Key"
BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}


def _turn(router, session: str, **extra):
    answer = router.generate({**BODY, **extra}, headers={KEY: session})
    assert answer.status_code == 200, answer.text
    return answer.json()["meta_info"]["routed_worker"]


def test_sessions_stay_on_their_worker_and_move_when_it_dies():
    fakes = [FakeWorker(weight_version="3") for _ in range(3)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(fake_worker_app(f))) for f in fakes]
        dying = contextlib.ExitStack()
        dead_url = dying.enter_context(serve_in_thread(fake_worker_app(dead := FakeWorker(weight_version="3"))))
        with inprocess_router(workers=(*urls, dead_url), health_check_interval_s=30.0) as router:
            sessions = [f"s{i}" for i in range(16)]
            placed = {s: _turn(router, s) for s in sessions}
            assert len(set(placed.values())) == 4  # new sessions spread over the least loaded
            for _ in range(3):
                assert {s: _turn(router, s) for s in sessions} == placed
            generated = [body for f in (*fakes, dead) for path, body in f.received if path == "/generate"]
            assert generated and all(body["extra_key"] == "weight-version:3" for body in generated)
            _turn(router, "own", extra_key="mine")  # a namespace the client chose is kept
            assert any(b.get("extra_key") == "mine" for f in (*fakes, dead) for _, b in f.received)
            router.generate(BODY)  # no key: no namespace added
            assert any("extra_key" not in b for f in (*fakes, dead) for _, b in f.received)

            dying.close()  # the worker dies: its sessions' next turns move and are served
            orphans = [s for s, url in placed.items() if url == dead_url]
            moved = {s: _turn(router, s) for s in orphans}
            assert orphans and all(url != dead_url for url in moved.values())
            assert {s: _turn(router, s) for s in orphans} == moved  # and stay where they went
            metrics = router.http.get("/metrics").json()
            assert metrics["session_moves"] == len(orphans)
            assert metrics["session_affinity_hits"] >= 3 * len(sessions) + len(orphans)


def test_a_bad_routing_key_is_a_400_naming_the_header():
    fake = FakeWorker(weight_version="1")
    with serve_in_thread(fake_worker_app(fake)) as url, inprocess_router(workers=(url,)) as router:
        answer = router.generate(BODY, headers={KEY: "x" * 400})
        assert answer.status_code == 400 and "x-smg-routing-key" in answer.json()["message"]
        assert fake.received == []
