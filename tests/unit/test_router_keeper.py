"""The run's control calls to its router (``fleet/router_keeper.py``), against a fake router process:
retried while a live router does not answer, the router restarted (and its workers registered again
from the run's record) once its process exited or it stayed silent past the bound; one restart for
callers that failed on the same router; a refusal is never retried."""

from __future__ import annotations

import threading

import pytest

from miles_disagg.fleet import router_keeper
from miles_disagg.fleet.router_keeper import GuardedRouter, RouterKeeper
from miles_disagg.router.client import RouterUnreachable
from miles_disagg.types import InvalidInput


class FakeProc:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


class FakeRouter:
    url = "http://127.0.0.1:1"

    def __init__(self) -> None:
        self.proc = FakeProc()


class FakeClient:
    """Answers after ``silent`` unanswered calls; records what it was asked."""

    def __init__(self, silent: int = 0) -> None:
        self.silent, self.calls = silent, []

    def _answer(self, *call):
        self.calls.append(call)
        if self.silent:
            self.silent -= 1
            raise RouterUnreachable("POST /set_worker_state: ReadError: [Errno 104] Connection reset by peer")
        return {"url": call[1] if len(call) > 1 else None}

    def add_worker(self, url):
        return self._answer("add_worker", url)

    def set_worker_state(self, url, state, **_):
        return self._answer("set_worker_state", url, state)

    def remove_worker(self, url):
        raise InvalidInput("unknown worker")


class FakeRouting:
    def __init__(self, client: FakeClient, members: list[str]) -> None:
        self.router, self.raw_client, self.member_urls = FakeRouter(), client, members
        self.relaunched: list[FakeClient] = []

    def relaunch(self) -> None:
        self.router = FakeRouter()
        self.raw_client = FakeClient()
        self.relaunched.append(self.raw_client)

    def members(self) -> list[str]:
        return list(self.member_urls)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def keeper_of(routing: FakeRouting, events: list[dict]) -> tuple[RouterKeeper, Clock]:
    clock = Clock()
    return RouterKeeper(routing, events.append, threading.Event(), clock=clock, sleep=clock.sleep), clock


def test_a_live_router_that_answers_again_within_the_bound_is_not_restarted() -> None:
    routing, events = FakeRouting(FakeClient(silent=20), ["http://e:1"]), []
    keeper, clock = keeper_of(routing, events)
    assert GuardedRouter(keeper).set_worker_state("http://e:1", "paused") == {"url": "http://e:1"}
    assert keeper.restarts == 0 and keeper.call_retries == 20 and events == [] and routing.relaunched == []
    assert clock.now < router_keeper.STALL_BOUND_S


def test_a_live_router_silent_past_the_bound_is_restarted_with_the_runs_workers() -> None:
    routing, events = FakeRouting(FakeClient(silent=10**6), ["http://e:1", "http://e:2"]), []
    keeper, clock = keeper_of(routing, events)
    guarded = GuardedRouter(keeper)
    keeper.intended["http://e:2"] = "paused"  # the run had paused it (an activation in flight)
    assert guarded.set_worker_state("http://e:1", "ready") == {"url": "http://e:1"}
    [new] = routing.relaunched
    assert new.calls == [("add_worker", "http://e:1"), ("add_worker", "http://e:2"),
                         ("set_worker_state", "http://e:2", "paused"), ("set_worker_state", "http://e:1", "ready")]
    assert clock.now >= router_keeper.STALL_BOUND_S
    [event] = events
    assert event["event"] == "router_restarted" and event["workers"] == ["http://e:1", "http://e:2"]
    assert "did not answer for" in event["why"] and "Connection reset by peer" in event["why"]
    assert keeper.metrics() == {"rollout/router_restarts": 1.0,
                                "rollout/router_call_retries": float(keeper.call_retries)}


def test_a_router_whose_process_exited_is_restarted_at_once() -> None:
    routing, events = FakeRouting(FakeClient(silent=10**6), ["http://e:1"]), []
    keeper, clock = keeper_of(routing, events)
    routing.router.proc.code = -9
    GuardedRouter(keeper).add_worker("http://e:1")
    assert keeper.restarts == 1 and keeper.call_retries == 0 and clock.now == 0.0
    assert events[0]["why"] == "its process exited (code -9)"


def test_callers_that_failed_on_one_router_share_one_restart() -> None:
    routing, events = FakeRouting(FakeClient(), []), []
    keeper, _ = keeper_of(routing, events)
    seen = keeper.generation
    keeper.restart(seen, why="first caller")
    keeper.restart(seen, why="second caller, same router")  # already restarted: nothing more
    assert keeper.restarts == 1 and len(routing.relaunched) == 1 and [e["why"] for e in events] == ["first caller"]


def test_the_monitor_restarts_a_dead_router_and_a_refusal_is_not_retried() -> None:
    routing, events = FakeRouting(FakeClient(), ["http://e:1"]), []
    keeper, _ = keeper_of(routing, events)
    routing.router.proc.code = 1
    keeper.check()
    assert keeper.restarts == 1 and routing.relaunched[0].calls == [("add_worker", "http://e:1")]
    with pytest.raises(InvalidInput, match="unknown worker"):
        GuardedRouter(keeper).remove_worker("http://e:9")
    assert keeper.call_retries == 0


def test_a_call_failing_after_the_restart_raises() -> None:
    class DeadRouting(FakeRouting):
        def relaunch(self) -> None:
            super().relaunch()
            self.raw_client.silent = 10**6
            self.router.proc.code = 1  # the new one dies too

    routing, events = DeadRouting(FakeClient(silent=10**6), []), []
    keeper, _ = keeper_of(routing, events)
    routing.router.proc.code = 1
    with pytest.raises(RouterUnreachable, match="also after it was restarted"):
        GuardedRouter(keeper).set_worker_state("http://e:1", "ready")
    assert keeper.restarts == 1


def test_the_monitor_restarts_a_live_router_only_once_it_answered_nothing_for_the_bound() -> None:
    """A probe that fails (nothing listens at the fake's address) right after the router answered a control
    call is no reason to restart it (a router busy after a stall, or a starved core): only silence as long
    as the bound is."""
    routing, events = FakeRouting(FakeClient(), ["http://e:1"]), []
    keeper, clock = keeper_of(routing, events)
    clock.now = 40.0
    GuardedRouter(keeper).add_worker("http://e:1")  # it answered the run at 40 s
    clock.now = 80.0
    keeper.check()
    assert keeper.restarts == 0
    clock.now = 86.0
    keeper.check()
    assert keeper.restarts == 1 and events[0]["why"].startswith("it answered nothing for 46s"), events


def test_a_restart_asked_from_a_short_lived_thread_starts_the_router_from_the_keepers_own_thread() -> None:
    """The router gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG is per thread):
    it must not be the caller's, which may be an update's worker thread."""
    routing, events = FakeRouting(FakeClient(), ["http://e:1"]), []
    starters: list[threading.Thread] = []
    relaunch = routing.relaunch
    routing.relaunch = lambda: (starters.append(threading.current_thread()), relaunch())
    keeper, _ = keeper_of(routing, events)
    routing.router.proc.code = -9  # the process was killed
    for _ in range(2):
        caller = threading.Thread(target=keeper.check)
        caller.start()
        caller.join()
        routing.router.proc.code = -9
    assert len(starters) == 2 and starters[0] is starters[1]  # one long-lived launcher, not the callers
    assert starters[0].is_alive() and starters[0] is not threading.current_thread()
