"""``unless_client_gone``: the upstream send runs in the caller's task; a client that leaves first
cancels it (``ClientGone``), and a send that wins leaves no cancellation behind."""

from __future__ import annotations

import asyncio

import pytest

from miles_disagg.router.client_gone import ClientGone, unless_client_gone


class FakeRequest:
    """``receive`` blocks until ``leave()``, then reports the disconnect."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    def leave(self) -> None:
        self.left.set()

    async def receive(self) -> dict:
        await self.left.wait()
        return {"type": "http.disconnect"}


def test_a_send_that_wins_returns_and_leaves_the_task_uncancelled():
    async def main():
        request = FakeRequest()
        result = await unless_client_gone(request, asyncio.sleep(0.01, result="reply"))
        request.leave()  # the client leaving afterwards changes nothing
        await asyncio.sleep(0.05)
        return result, asyncio.current_task().cancelling()

    assert asyncio.run(main()) == ("reply", 0)


def test_a_client_that_leaves_first_cancels_the_send():
    async def main():
        request = FakeRequest()
        cancelled = asyncio.Event()

        async def send():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        asyncio.get_running_loop().call_later(0.02, request.leave)
        with pytest.raises(ClientGone):
            await unless_client_gone(request, send())
        await asyncio.sleep(0)  # the task goes on normally
        return cancelled.is_set(), asyncio.current_task().cancelling()

    assert asyncio.run(main()) == (True, 0)


def test_an_outside_cancel_still_cancels():
    async def main():
        task = asyncio.ensure_future(unless_client_gone(FakeRequest(), asyncio.sleep(30)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_errors_of_the_send_pass_through():
    async def fail():
        raise ValueError("upstream")

    with pytest.raises(ValueError, match="upstream"):
        asyncio.run(unless_client_gone(FakeRequest(), fail()))
