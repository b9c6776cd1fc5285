"""``miles.utils.http_utils`` (``post``, ``get``) and ``miles.utils.misc.load_function``.

A generate hook's ``args.sglang_router_ip/port`` name its sample's own router address (see
``rollout/attribution.py``), so whatever ``post`` sends there is recorded against that sample.
"""

from __future__ import annotations

import asyncio
from typing import Any

TRANSPORT_RETRY_S = 0.5


class HttpError(RuntimeError):
    """A request answered with a non-2xx status (one line: the status and the body's start)."""


async def post(url: str, payload: Any = None, max_retries: int = 60, action: str = "post") -> Any:
    """miles' ``post``: send ``payload`` as JSON with ``action`` (post/put/...), return the JSON answer.
    Transport failures are retried up to ``max_retries`` times; an error status raises at once."""
    import httpx

    last: Exception | None = None
    for _ in range(max(1, int(max_retries))):
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as client:
                response = await client.request(action.upper(), url, json=payload)
        except httpx.TransportError as exc:
            last = exc
            await asyncio.sleep(TRANSPORT_RETRY_S)
            continue
        return _json_of(response, url)
    raise HttpError(f"{action.upper()} {url}: no answer after {max_retries} tries ({last})")


async def get(url: str) -> Any:
    """miles' ``get``: the JSON answer of ``GET url``."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as client:
        return _json_of(await client.get(url), url)


def _json_of(response, url: str) -> Any:
    if not response.is_success:
        raise HttpError(f"{response.request.method} {url} answered {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError:
        return response.text


def load_function(path: str) -> Any:
    """miles' ``load_function``: the object at dotted ``pkg.module.name``."""
    from miles_disagg.rollout.hooks import import_path

    return import_path(path, "load_function")


__all__ = ["post", "get", "load_function"]
