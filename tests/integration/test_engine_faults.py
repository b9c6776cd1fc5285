"""Faults on the scheduler thread are never silent: 5xx to the requests they hit, /health shows them.

In process (the faults are injected into the live engine), over real HTTP.
"""

from __future__ import annotations

import os
import threading

import pytest

from engine_fixtures import ENGINE_URL_ENV, Background, inprocess_engine, wait_until

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(bool(os.environ.get(ENGINE_URL_ENV)), reason="injects faults into the built-in engine"),
]
BODY = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}}


class _Boom(Exception):
    pass


class _ThreadKiller(BaseException):
    """Escapes the per-step guard, as a bug in the loop itself would."""


def _fail_decode_once(engine, exc: BaseException, armed: threading.Event) -> None:
    real = engine.runner.decode

    def decode(*args, **kwargs):
        if armed.is_set():
            armed.clear()
            raise exc
        return real(*args, **kwargs)

    engine.runner.decode = decode


def test_step_fault_fails_the_batch_with_500_and_shows_in_health(tiny_qwen3_dir):
    with inprocess_engine(tiny_qwen3_dir) as (engine, handle):
        armed = threading.Event()
        _fail_decode_once(engine, _Boom("injected decode failure"), armed)
        armed.set()
        response = handle.post("/generate", BODY)
        assert response.status_code == 500, response.text
        assert "injected decode failure" in response.json()["error"]["message"]
        health = handle.get("/health")
        assert health.status_code == 503 and "injected decode failure" in health.json()["error"]
        assert handle.internal_state()["num_faults"] == 1
        # the engine keeps serving; a clean forward pass clears the fault
        assert handle.generate(BODY)["meta_info"]["completion_tokens"] == 4
        assert handle.get("/health").status_code == 200


def test_stream_fault_ends_with_an_error_event(tiny_qwen3_dir):
    with inprocess_engine(tiny_qwen3_dir) as (engine, handle):
        armed = threading.Event()
        _fail_decode_once(engine, _Boom("injected stream failure"), armed)
        armed.set()
        response = handle.post("/generate", {**BODY, "stream": True})
        from engine_fixtures import sse_events

        events = sse_events(response)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500


def test_dead_scheduler_fails_everything_fast_and_health_says_why(tiny_qwen3_dir):
    with inprocess_engine(tiny_qwen3_dir) as (engine, handle):
        armed = threading.Event()
        _fail_decode_once(engine, _ThreadKiller("scheduler loop bug"), armed)
        in_flight = Background(lambda: handle.post("/generate", {**BODY, "sampling_params": {
            **BODY["sampling_params"], "max_new_tokens": 1500}}))
        wait_until(lambda: engine.scheduler.running, what="a request in flight")
        armed.set()
        response = in_flight.result()
        assert response.status_code >= 500 and "scheduler loop bug" in response.json()["error"]["message"]
        wait_until(lambda: engine.scheduler.dead is not None, what="scheduler marked dead")
        health = handle.get("/health")
        assert health.status_code == 503 and "scheduler loop bug" in health.json()["error"]
        assert handle.get("/health_generate").status_code == 503
        later = handle.post("/generate", BODY)
        assert later.status_code == 503, later.text
        paused = handle.post("/pause_generation", {"mode": "retract"})  # commands fail instead of hanging
        assert paused.status_code == 503, paused.text
