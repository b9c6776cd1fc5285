"""A router whose own event loop is overloaded must not take live workers out: a probe that times out
while the worker answers proxied requests does not count, and a connect timeout to a worker that just
answered moves the request to another worker without marking it failed (a refused connection still
does). A request never tries the same worker twice."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from registry_workers import answer_one, ready

from miles_disagg.net.pooled_http import ConnectTimedOut, NotConnected, Reply
from miles_disagg.router.config import RouterConfig
from miles_disagg.router.proxy import ProxyRecord, Router
from miles_disagg.router.policy import LeastOutstandingPolicy, NoWorkerAvailable
from miles_disagg.router.registry import WorkerRegistry, WorkerState
from miles_disagg.types import VersionConstraint

ANY = VersionConstraint()


def test_a_probe_timeout_while_the_worker_answers_requests_is_not_counted():
    registry = WorkerRegistry(failure_threshold=1)
    worker = ready(registry, "http://a:1")
    ticket = registry.ticket(worker)
    answer_one(registry, worker)  # it answered while the probe was out
    registry.record_probe_failure(worker, "GET /health timed out", definite=False, ticket=ticket)
    assert worker.state is WorkerState.READY and worker.consecutive_failures == 0
    registry.record_probe_failure(worker, "GET /health timed out", definite=False, ticket=registry.ticket(worker))
    assert worker.state is WorkerState.UNHEALTHY  # no answer meanwhile: counted


def test_a_definite_probe_failure_counts_even_while_answering():
    registry = WorkerRegistry()
    worker = ready(registry, "http://a:1")
    ticket = registry.ticket(worker)
    answer_one(registry, worker)
    registry.record_probe_failure(worker, "/health answered 500", definite=True, ticket=ticket)
    assert worker.state is WorkerState.UNHEALTHY


def test_choose_in_skips_workers_already_tried():
    registry = WorkerRegistry()
    a, b = ready(registry, "http://a:1"), ready(registry, "http://b:1")
    policy = LeastOutstandingPolicy()
    assert policy.choose_in(registry, ANY, skip={a}) is b
    with pytest.raises(NoWorkerAvailable):
        policy.choose_in(registry, ANY, skip={a, b})


class FakeClient:
    """``post`` fails for the URLs in ``fail`` (with that error) and answers 200 otherwise."""

    def __init__(self, fail: dict[str, Exception]):
        self.fail, self.sent = fail, []

    async def post(self, base_url: str, path: str, body: bytes, headers: dict):
        url = base_url + path
        self.sent.append(url)
        for prefix, error in self.fail.items():
            if url.startswith(prefix):
                raise error
        return Reply(200, b'{"text": "x", "meta_info": {"weight_version": "1"}}', {"content-type": "application/json"})


class Gone:
    state = SimpleNamespace()

    async def receive(self):
        await asyncio.Event().wait()


def route(router: Router):
    record = ProxyRecord(ANY)
    response = asyncio.run(router._route(Gone(), "/generate", b'{"input_ids": [1]}', record))
    return response, record


@pytest.mark.parametrize("answered_recently", [True, False])
def test_connect_timeout_moves_the_request_and_keeps_a_live_worker(answered_recently):
    router = Router(RouterConfig())
    a, b = ready(router.registry, "http://a:1"), ready(router.registry, "http://b:1")
    if answered_recently:
        answer_one(router.registry, a)
    router.registry.acquire(b)  # a is the least loaded: tried first
    router._client = FakeClient({"http://a:1": ConnectTimedOut("connecting timed out")})
    response, record = route(router)
    assert response.status_code == 200 and record.worker == b.url
    assert router._client.sent == ["http://a:1/generate", "http://b:1/generate"]
    assert (a.state is WorkerState.READY) is answered_recently
    assert router.counters["connect_timeouts_of_live_workers"] == int(answered_recently)


def test_refused_connections_still_take_the_worker_out_and_each_worker_is_tried_once():
    router = Router(RouterConfig())
    a, b = ready(router.registry, "http://a:1"), ready(router.registry, "http://b:1")
    answer_one(router.registry, a)
    answer_one(router.registry, b)
    router._client = FakeClient({"http://a:1": NotConnected("refused"),
                                 "http://b:1": ConnectTimedOut("connecting timed out")})
    response, _ = route(router)
    assert response.status_code == 503
    assert sorted(router._client.sent) == ["http://a:1/generate", "http://b:1/generate"]
    assert a.state is WorkerState.UNHEALTHY and b.state is WorkerState.READY


def test_loop_lag_sees_a_blocked_loop_and_excuses_only_its_timeouts():
    import time

    from miles_disagg.router.loop_lag import LoopLag

    async def main():
        lag = LoopLag(period_s=0.02)
        task = asyncio.ensure_future(lag.run_forever())
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0.1)
        calm = loop.time()
        await asyncio.sleep(0.1)
        calm_excuses = lag.excuses(calm, timeout_s=0.4)
        blocked = loop.time()
        time.sleep(0.3)  # the loop cannot run anything meanwhile
        await asyncio.sleep(0.05)
        task.cancel()
        return calm_excuses, lag.worst_since(blocked), lag.excuses(blocked, timeout_s=0.4), lag.excuses(blocked, 2.0)

    calm_excuses, worst, excused, long_timeout_excused = asyncio.run(main())
    assert not calm_excuses and worst >= 0.25 and excused and not long_timeout_excused


def test_connect_timeout_while_the_router_lagged_keeps_a_worker_that_never_answered():
    router = Router(RouterConfig(connect_timeout_s=0.2))
    a, b = ready(router.registry, "http://a:1"), ready(router.registry, "http://b:1")
    router.registry.acquire(b)

    class LaggingClient(FakeClient):
        async def post(self, base_url: str, *args):
            if base_url.startswith("http://a:1"):
                import time
                time.sleep(0.3)  # the router's loop stalls while this connect is pending
            return await super().post(base_url, *args)

    router._client = LaggingClient({"http://a:1": ConnectTimedOut("connecting timed out")})

    async def main():
        task = asyncio.ensure_future(router.loop_lag.run_forever())
        await asyncio.sleep(0.05)
        try:
            return await router._route(Gone(), "/generate", b'{"input_ids": [1]}', ProxyRecord(ANY))
        finally:
            task.cancel()

    response = asyncio.run(main())
    assert response.status_code == 200 and a.state is WorkerState.READY
    assert router.counters["connect_timeouts_of_live_workers"] == 1
