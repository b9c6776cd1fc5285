"""The activation lifecycle is written once and runs over a synchronous port (``activate``) or an
asynchronous one (``activate_async``, the fan-out's): same order of calls, same failures."""

from __future__ import annotations

import asyncio

import pytest

from miles_disagg.engines.activation import ActivationFailed, activate, activate_async, prepare, prepare_async


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
