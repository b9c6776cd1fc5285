"""A fake version-aware router for driving the rollout manager without sockets, engines or Ray.

It answers ``/generate`` through an ``httpx.MockTransport``; every request waits until the test
says which version serves it and what it generates (``answer``), so a test decides the exact
order of events. Requests are kept in arrival order with their version constraint.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx

DEADLINE_S = 60.0  # generous: a wait that runs out means the manager stopped asking (a hang)


def digit_ids(text: str) -> list[int]:
    """Token ids of digits in the tiny digits tokenizer (``"0"`` is id 3)."""
    return [int(ch) + 3 for ch in text]


@dataclass
class Request:
    body: dict
    answered: asyncio.Future = field(repr=False)

    @property
    def num_samples(self) -> int:
        ids = self.body["input_ids"]
        return len(ids) if ids and isinstance(ids[0], list) else 1

    @property
    def constraint(self) -> dict:
        return self.body.get("weight_version") or {}

    @property
    def min_version(self) -> int | None:
        return self.constraint.get("min_version")

    @property
    def input_ids(self) -> list[int]:
        return self.body["input_ids"]


class FakeRouter:
    """``transport`` goes to the manager; ``requests`` fill up as the manager sends them."""

    def __init__(self):
        self.requests: list[Request] = []
        self._arrived: asyncio.Condition | None = None
        self.transport = httpx.MockTransport(self._handle)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        if self._arrived is None:
            self._arrived = asyncio.Condition()
        entry = Request(json.loads(request.content), asyncio.get_running_loop().create_future())
        async with self._arrived:
            self.requests.append(entry)
            self._arrived.notify_all()
        version, outputs = await entry.answered
        results = [_result(output, version) for output in outputs]
        return httpx.Response(200, json=results if isinstance(entry.body["input_ids"][0], list) else results[0])

    async def wait_requests(self, count: int) -> list[Request]:
        """Until ``count`` requests have arrived (in all); the requests so far."""
        async def arrived():
            while self._arrived is None:
                await asyncio.sleep(0)
            async with self._arrived:
                await self._arrived.wait_for(lambda: len(self.requests) >= count)
        await asyncio.wait_for(arrived(), DEADLINE_S)
        return list(self.requests)

    def answer(self, request: Request, version: int | tuple[int, int], outputs: list[str] | str = "123") -> None:
        """Serve ``request`` with ``version`` (or a (start, end) pair); ``outputs``: each sample's digits
        (one string for all samples)."""
        pair = (version, version) if isinstance(version, int) else version
        texts = [outputs] * request.num_samples if isinstance(outputs, str) else list(outputs)
        request.answered.set_result((pair, texts))


def _result(text: str, versions: tuple[int, int]) -> dict:
    ids = digit_ids(text)
    return {"text": text, "output_ids": ids,
            "meta_info": {"output_token_logprobs": [[-0.5, i, None] for i in ids],
                          "finish_reason": {"type": "length"}, "weight_version": str(versions[1]),
                          "weight_version_start": versions[0], "weight_version_end": versions[1]}}


async def wait_until(predicate, what: str) -> None:
    """Yield to the event loop until ``predicate()`` holds (bounded by the deadline)."""
    async def spin():
        while not predicate():
            await asyncio.sleep(0.001)
    try:
        await asyncio.wait_for(spin(), DEADLINE_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None
