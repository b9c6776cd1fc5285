"""The async HTTP client of the generation hot path: the rollout manager's requests to the
router (or a rollout service). (The router and the service gateway reach the engines through a leaner
client of their own, :mod:`miles_disagg.router.upstream`; its :class:`Reply` and failure types are these.)

Why not ``httpx`` there: its connection pool (httpcore) scans every pooled connection on each
request it starts and each response it closes, asking each whether it is idle and still
readable. At a rollout concurrency of 128 that bookkeeping took more than half of the rollout
manager's CPU, and three quarters of the router's, in a multi-turn run (py-spy). aiohttp's
connector keeps idle connections per host and hands one out without a scan. Control traffic
(health probes, activation, the CLIs) stays on ``httpx``: a few requests, no pool to speak of.

A :class:`Reply` is read whole and has the ``status_code``, ``content``, ``text``, ``headers``,
``is_success`` and ``json()`` its readers use (the same names as an ``httpx.Response``, so a test
may still hand the rollout manager an ``httpx`` client with a fake router's transport).
Transport failures are typed by what the caller must do: :class:`NotConnected` (nothing was
sent; another server may take the request) or :class:`TransportFailed` (it may have been sent).
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from miles_disagg.net.keyed_client import KEEPALIVE_EXPIRY_S


class TransportFailed(Exception):
    """The request failed on the wire after it may have reached the server (reset, timeout)."""


class NotConnected(TransportFailed):
    """No connection could be made: the request was never sent."""


class ConnectTimedOut(NotConnected):
    """Connecting took longer than the connect timeout (nothing was sent; the server may be overloaded)."""


class TimedOut(TransportFailed):
    """No (whole) answer within the timeout."""


@dataclass(frozen=True)
class Reply:
    status_code: int
    content: bytes
    headers: Mapping[str, str]

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    def json(self) -> Any:
        return jsonlib.loads(self.content)


class PooledSession:
    """One aiohttp session: ``post(url, json=... | content=...)`` and ``get(url)`` -> :class:`Reply`."""

    def __init__(self, *, max_connections: int | None, connect_timeout_s: float, read_timeout_s: float | None,
                 headers: Mapping[str, str] | None = None, total_timeout_s: float | None = None):
        """Make it on the event loop it will be used on (aiohttp binds to the running loop).
        ``max_connections``: None for no bound. ``total_timeout_s``: bound of a whole request (probes)."""
        import aiohttp

        # Idle connections are dropped before a uvicorn server closes them from its side (5 s):
        # a request sent on a connection the server is closing reads as "connection reset".
        self._connect_timeout_s = connect_timeout_s
        connector = aiohttp.TCPConnector(limit=max_connections or 0, keepalive_timeout=KEEPALIVE_EXPIRY_S)
        timeout = aiohttp.ClientTimeout(total=total_timeout_s, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        # trust_env stays False: traffic inside the cluster never goes through an environment proxy
        # no cookie jar: nothing of ours sets cookies, and the jar's bookkeeping costs on every request
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=dict(headers or {}),
                                              cookie_jar=aiohttp.DummyCookieJar())

    async def post(self, url: str, *, json: Any = None, content: bytes | None = None,
                   headers: Mapping[str, str] | None = None, timeout_s: float | None = None) -> Reply:
        """``timeout_s``: a bound of this whole request (None: the session's timeouts)."""
        if json is not None:
            content = jsonlib.dumps(json).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        return await self._request("POST", url, timeout_s, data=content, headers=headers)

    async def get(self, url: str, *, headers: Mapping[str, str] | None = None, timeout_s: float | None = None) -> Reply:
        return await self._request("GET", url, timeout_s, headers=headers)

    async def _request(self, method: str, url: str, timeout_s: float | None, **kwargs: Any) -> Reply:
        import aiohttp

        if timeout_s is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._connect_timeout_s)
        try:
            async with self._session.request(method, url, **kwargs) as response:
                return Reply(response.status, await response.read(), response.headers)
        except aiohttp.ClientConnectorError as exc:
            raise NotConnected(f"cannot connect to {url}: {exc}") from exc
        except aiohttp.ConnectionTimeoutError as exc:
            raise ConnectTimedOut(f"connecting to {url} timed out") from exc
        except (aiohttp.ServerTimeoutError, asyncio.TimeoutError) as exc:
            raise TimedOut(f"{method} {url}: no answer in time ({type(exc).__name__})") from exc
        except aiohttp.ClientError as exc:
            raise TransportFailed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc

    async def aclose(self) -> None:
        await self._session.close()


def loop_factory():
    """``uvloop.new_event_loop`` where uvloop is installed (pyproject installs it except on Windows), else
    ``asyncio.new_event_loop``: for the loops this project runs itself, as uvicorn does for its servers.

    Why: a weight update to 256 engines is about 1,500 small requests, and 256 simulated engines in one
    process answer them; both are event-loop bound on a 2-core machine, and uvloop cuts the loop's own
    cost per request (the updater's CPU per update at 256 engines: 0.34 s -> 0.31 s, the simulated
    engines' 0.25 s -> 0.19 s). Behaviour is asyncio's; nothing may rely on either loop's internals."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run_loop(coroutine: Any) -> Any:
    """``asyncio.run(coroutine)`` on a loop from :func:`loop_factory`."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coroutine)
