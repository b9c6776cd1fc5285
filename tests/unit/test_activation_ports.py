"""The activation lifecycle is written once and runs over a synchronous port (``activate``) or an
asynchronous one (``activate_async``, the fan-out's): same order of calls, same failures. A port
whose engine announced ``/activate_weights`` gets the whole of step 2 as one call, with the same
failure rules."""

from __future__ import annotations

import asyncio

import pytest

from miles_disagg.engines.activation import (ActivationFailed, activate, activate_async, offers_one_call, prepare,
                                             prepare_async)
from miles_disagg.engines.client import EngineRefused
from miles_disagg.types import EngineUnreachable, EngineUnrecoverable


class SyncPort:
    def __init__(self, fail: str | None = None):
        self.calls: list[str] = []
        self.fail, self.held = fail, 0

    def _do(self, what: str) -> None:
        self.calls.append(what)
        if what == self.fail:
            raise RuntimeError(f"{what} broke")

    def pull(self, version: int) -> None:
        self._do("pull")

    def pause(self, mode: str) -> None:
        self._do(f"pause:{mode}")

    def flush(self) -> None:
        self._do("flush")

    def load(self, version: int) -> None:
        self._do("load")
        self.held = version

    def resume(self) -> None:
        self._do("resume")

    def version(self) -> int:
        self._do("version")
        return self.held


class AsyncPort(SyncPort):
    """The same engine with coroutine methods; each yields to the loop once."""

    def __getattribute__(self, name: str):
        method = super().__getattribute__(name)
        if name not in ("pull", "pause", "flush", "load", "resume", "version"):
            return method

        async def call(*args):
            await asyncio.sleep(0)
            return method(*args)
        return call


def test_both_ports_see_the_same_calls_in_the_same_order() -> None:
    sync, asynchronous = SyncPort(), AsyncPort()
    prepare(sync, 3)
    activate(sync, 3, pause_mode="retract")
    asyncio.run(prepare_async(asynchronous, 3))
    asyncio.run(activate_async(asynchronous, 3, pause_mode="retract"))
    expected = ["pull", "pause:retract", "flush", "load", "resume", "version"]
    assert sync.calls == expected and asynchronous.calls == expected


@pytest.mark.parametrize("port_kind", [SyncPort, AsyncPort])
def test_a_failed_load_still_continues_the_engine_and_fails_the_activation(port_kind) -> None:
    port = port_kind(fail="load")
    with pytest.raises(ActivationFailed, match="load broke"):
        if port_kind is SyncPort:
            activate(port, 4, pause_mode="in_place")
        else:
            asyncio.run(activate_async(port, 4, pause_mode="in_place"))
    assert port.calls == ["pause:in_place", "load", "resume"]  # in_place: no flush; resumed whatever happened


def test_the_synchronous_driver_refuses_an_asynchronous_port() -> None:
    with pytest.raises(TypeError, match="activate_async"):
        prepare(AsyncPort(), 1)


# --------------------------------------------------------------------------- one-call activation


class OneCallPort(SyncPort):
    """An engine that announced /activate_weights: the lifecycle runs on its side, in one call."""

    one_call_activation = True

    def __init__(self, answer: dict | None = None, error: Exception | None = None):
        super().__init__()
        self.answer, self.error = answer, error

    def activate_in_one_call(self, version: int, pause_mode: str, flush: bool) -> dict:
        self.calls.append(f"one_call:{version}:{pause_mode}:{flush}")
        if self.error is not None:
            raise self.error
        return self.answer if self.answer is not None else {"weight_version": str(version), "pause_ms": 1.5}


def test_an_announcing_port_gets_one_call_and_its_own_pause_is_reported() -> None:
    port = OneCallPort()
    assert activate(port, 5, pause_mode="in_place") == pytest.approx(1.5e-3)
    assert port.calls == ["one_call:5:in_place:False"]  # flush defaults as in the steps
    assert asyncio.run(activate_async(port, 5, pause_mode="retract")) == pytest.approx(1.5e-3)
    assert port.calls[-1] == "one_call:5:retract:True"


def test_a_custom_load_or_a_paused_hook_keeps_the_steps() -> None:
    port = OneCallPort()
    activate(port, 2, pause_mode="retract", on_paused=lambda: None)
    assert port.calls == ["pause:retract", "flush", "load", "resume", "version"]


@pytest.mark.parametrize("error, continued", [
    (EngineUnrecoverable("http://e/activate_weights answered 503: activation of v3 failed: load broke"), False),
    (EngineRefused("http://e/activate_weights answered 401: missing key"), False),
    (EngineUnreachable("http://e/activate_weights: TimedOut"), True),  # no answer: it may be paused still
])
def test_any_fault_of_the_one_call_fails_the_activation(error: Exception, continued: bool) -> None:
    port = OneCallPort(error=error)
    with pytest.raises(ActivationFailed, match=f"activation of v3 failed: {type(error).__name__}"):
        activate(port, 3, pause_mode="retract")
    assert port.calls == ["one_call:3:retract:True"] + (["resume"] if continued else [])


@pytest.mark.parametrize("answer, why", [
    ({"weight_version": "2", "pause_ms": 1.0}, "reports version 2"),
    ({"weight_version": "3"}, "no pause_ms"),
    ({"weight_version": "3", "pause_ms": True}, "no pause_ms"),
])
def test_an_answer_that_does_not_show_the_version_active_fails_the_activation(answer: dict, why: str) -> None:
    with pytest.raises(ActivationFailed, match=why):
        activate(OneCallPort(answer=answer), 3, pause_mode="retract")


def test_the_announcement_is_read_from_a_pull_answer() -> None:
    assert offers_one_call({"success": True, "miles_disagg": {"activate_weights": True}})
    for answer in ({"success": True}, {"miles_disagg": {"activate_weights": "yes"}}, {"miles_disagg": []}, None, []):
        assert not offers_one_call(answer)
