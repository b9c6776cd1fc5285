"""The proxy's client towards the workers: HTTP/1.1 keep-alive over asyncio protocols, parsed by httptools.

Why not aiohttp (:class:`~miles_disagg.net.pooled_http.PooledSession`, which the rollout manager uses): each
proxied request went through its session, request, connector, timer and tracing layers, about 110 us of CPU
against about 35 us here for the same request and answer (one asyncio client, 64 in flight, the simulated
engines; ``bench scale`` profiles with py-spy put aiohttp at a fifth of the router's CPU per request).
This client does only what the proxy and its probes need: ``POST`` a whole body (or ``GET``), read the whole
answer.

Contracts:

* One request per connection at a time; a connection whose answer was read whole and that the server keeps
  alive goes back to its worker's idle stack; idle connections are dropped after
  :data:`~miles_disagg.net.keyed_client.KEEPALIVE_EXPIRY_S`, before a uvicorn server closes them (5 s): a
  request sent on a connection the server is closing would read as a worker failure.
* Failures are typed as :mod:`~miles_disagg.net.pooled_http` types them: :class:`NotConnected` (no
  connection: nothing was sent), :class:`ConnectTimedOut`, :class:`TimedOut` (no whole answer within the
  read timeout, counted from the last byte received), :class:`TransportFailed` (lost or garbled after the
  request may have been sent). A cancelled request closes its connection, so the engine sees the client leave.
* ``https://`` workers get TLS with the default context (the CA bundle), as before.
"""

from __future__ import annotations

import asyncio
import collections
import ssl as ssl_lib
import time
from typing import Mapping
from urllib.parse import urlsplit

from miles_disagg.net.keyed_client import KEEPALIVE_EXPIRY_S
from miles_disagg.net.pooled_http import ConnectTimedOut, NotConnected, Reply, TimedOut, TransportFailed


class _Target:
    """Where one worker is: address, the ``Host`` header, TLS, and its idle connections (newest last)."""

    __slots__ = ("host", "port", "host_header", "tls", "idle")

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise NotConnected(f"cannot connect to {base_url!r}: not an http(s) URL with a host")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.host_header = parts.netloc.rpartition("@")[2].encode("latin-1")
        self.idle: collections.deque[_Connection] = collections.deque()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; :meth:`send` writes a request and returns a future of its answer."""

    def __init__(self, target: _Target):
        self.target = target
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future | None = None
        self.parser = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.headers_done = False
        self.closed = False
        self.idle_since = 0.0
        self.last_data = 0.0

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        try:
            self.target.idle.remove(self)
        except ValueError:
            pass
        if self.waiter is not None and not self.waiter.done():
            if self.headers_done and self.parser is not None and "content-length" not in self.headers \
                    and "chunked" not in self.headers.get("transfer-encoding", ""):
                self._complete(keep_alive=False)  # an answer delimited by the close itself
            else:
                lost = TransportFailed(f"connection closed before the whole answer ({exc or 'EOF'})")
                self.waiter.set_exception(lost)

    def data_received(self, data: bytes) -> None:
        import httptools

        self.last_data = time.monotonic()
        if self.parser is None:  # nothing asked: a server talking out of turn
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(TransportFailed(f"malformed HTTP answer: {exc}"))
            self.close()

    # ------------------------------------------------------------------ httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self._complete(keep_alive=self.parser.should_keep_alive())

    # ------------------------------------------------------------------ use

    def _complete(self, *, keep_alive: bool) -> None:
        waiter, self.waiter = self.waiter, None
        reply = Reply(self.parser.get_status_code(), b"".join(self.chunks), self.headers)
        self.parser = None
        if waiter is not None and not waiter.done():
            waiter.set_result((reply, keep_alive))

    def send(self, request: bytes) -> asyncio.Future:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.headers, self.chunks, self.headers_done = {}, [], False
        self.waiter = asyncio.get_running_loop().create_future()
        self.last_data = time.monotonic()
        self.transport.write(request)
        return self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamClient:
    """``post(base_url, path, body, headers)`` -> :class:`Reply`; make it on the loop that uses it."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float = KEEPALIVE_EXPIRY_S):
        self.connect_timeout_s, self.read_timeout_s, self.keepalive_s = connect_timeout_s, read_timeout_s, keepalive_s
        self._targets: dict[str, _Target] = {}
        self._tls: ssl_lib.SSLContext | None = None

    async def post(self, base_url: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        """``POST base_url + path`` with ``body`` and ``headers`` (``Host`` and ``Content-Length`` are
        added); the whole answer, or a failure typed as the module docstring says."""
        return await self._request(b"POST", base_url, path, body, headers)

    async def get(self, base_url: str, path: str, headers: Mapping[str, str] | None = None) -> Reply:
        """``GET base_url + path`` (the health probes: small answers, so the read timeout bounds the whole)."""
        return await self._request(b"GET", base_url, path, b"", headers or {})

    async def _request(self, method: bytes, base_url: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        target = self._targets.get(base_url)
        if target is None:
            target = self._targets[base_url] = _Target(base_url)
        connection = self._idle_connection(target) or await self._connect(target, base_url)
        head = [method, b" ", path.encode("latin-1"), b" HTTP/1.1\r\nHost: ", target.host_header,
                b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers.items():
            head += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
        head += (b"\r\n", body)
        waiter = connection.send(b"".join(head))
        timer = asyncio.get_running_loop().call_later(self.read_timeout_s, self._check_read_timeout, connection, waiter)
        try:
            reply, keep_alive = await waiter
        except BaseException:  # cancelled (the client left), timed out or lost: the connection is done
            connection.close()
            raise
        finally:
            timer.cancel()
        if keep_alive and not connection.closed:
            connection.idle_since = time.monotonic()
            target.idle.append(connection)
        else:
            connection.close()
        return reply

    def _check_read_timeout(self, connection: _Connection, waiter: asyncio.Future) -> None:
        """Fail ``waiter`` when nothing came for the read timeout; else look again when it would be due."""
        if waiter.done():
            return
        quiet_s = time.monotonic() - connection.last_data
        if quiet_s >= self.read_timeout_s:
            waiter.set_exception(TimedOut(f"{connection.target.host}:{connection.target.port}: no answer "
                                          f"within {self.read_timeout_s:g} s"))
        else:
            asyncio.get_running_loop().call_later(self.read_timeout_s - quiet_s, self._check_read_timeout,
                                                  connection, waiter)

    def _idle_connection(self, target: _Target) -> _Connection | None:
        """The newest idle connection still open; older ones past the keep-alive are closed on the way."""
        idle = target.idle
        expired_before = time.monotonic() - self.keepalive_s
        while idle and idle[0].idle_since < expired_before:
            idle.popleft().close()
        while idle:
            connection = idle.pop()
            if not connection.closed and not connection.transport.is_closing():
                return connection
        return None

    async def _connect(self, target: _Target, base_url: str) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if target.tls else None
        connect = loop.create_connection(lambda: _Connection(target), target.host, target.port, ssl=tls,
                                         server_hostname=target.host if tls else None)
        try:
            _, connection = await asyncio.wait_for(connect, self.connect_timeout_s)
        except asyncio.TimeoutError as exc:
            raise ConnectTimedOut(f"connecting to {base_url} timed out") from exc
        except (OSError, ssl_lib.SSLError) as exc:
            raise NotConnected(f"cannot connect to {base_url}: {exc}") from exc
        return connection

    def _tls_context(self) -> ssl_lib.SSLContext:
        if self._tls is None:
            self._tls = ssl_lib.create_default_context()
        return self._tls

    async def aclose(self) -> None:
        """Close every idle connection (those in use close when their request ends)."""
        for target in self._targets.values():
            while target.idle:
                target.idle.pop().close()
