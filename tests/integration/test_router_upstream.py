"""The proxy's client towards the workers (:mod:`miles_disagg.router.upstream`) against scripted HTTP servers
on 127.0.0.1: keep-alive reuse, chunked and close-delimited answers, and every failure typed by what the
router must do with the worker (nothing sent: try another; maybe sent: a failed worker)."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import pytest

from miles_disagg.net.pooled_http import ConnectTimedOut, NotConnected, TimedOut, TransportFailed
from miles_disagg.router.upstream import UpstreamClient

pytestmark = pytest.mark.timeout(60)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return head, await reader.readexactly(length)


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


def run(handler: Handler, client_test: Callable[[str, list], Awaitable[None]], **client_options) -> list:
    """Serve ``handler`` on a free port; ``client_test(base_url, connections)``; returns the connections seen."""
    connections: list = []

    async def main() -> None:
        async def serve(reader, writer):
            connections.append(writer)
            try:
                await handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await client_test(f"http://127.0.0.1:{port}", connections)
        finally:
            server.close()

    asyncio.run(main())
    return connections


def client(**options) -> UpstreamClient:
    return UpstreamClient(**{"connect_timeout_s": 2.0, "read_timeout_s": 5.0, **options})


async def echo_forever(reader, writer) -> None:
    while True:
        head, body = await read_request(reader)
        host = head.split(b"Host: ")[1].split(b"\r\n")[0]
        writer.write(answer(b'{"echo": %s}' % body, b"X-Seen-Host: " + host + b"\r\n"))
        await writer.drain()


def test_keep_alive_reuses_one_connection_and_sends_the_headers_given() -> None:
    async def test(url: str, connections: list) -> None:
        upstream = client()
        for i in range(3):
            reply = await upstream.post(url, "/generate", b'[%d]' % i, {"Authorization": "Bearer k"})
            assert reply.status_code == 200 and reply.json() == {"echo": [i]}
            assert reply.headers["content-type"] == "application/json"
            assert reply.headers["x-seen-host"] == url.removeprefix("http://")
        assert len(connections) == 1
        await upstream.aclose()

    run(echo_forever, test)


def test_chunked_and_close_delimited_answers_are_read_whole() -> None:
    async def handler(reader, writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        await read_request(reader)
        writer.write(b"HTTP/1.1 503 Busy\r\nConnection: close\r\n\r\nnot now")
        await writer.drain()
        writer.close()

    async def test(url: str, connections: list) -> None:
        upstream = client()
        assert (await upstream.post(url, "/generate", b"{}", {})).content == b"abcde"
        reply = await upstream.post(url, "/generate", b"{}", {})
        assert (reply.status_code, reply.content) == (503, b"not now")
        assert (await upstream.post(url, "/generate", b"{}", {})).content == b"abcde"  # a new connection
        assert len(connections) == 2

    run(handler, test)


def test_a_refused_connection_is_not_connected() -> None:
    async def test(url: str, _connections: list) -> None:
        with pytest.raises(NotConnected) as caught:
            await client().post("http://127.0.0.1:1", "/generate", b"{}", {})
        assert not isinstance(caught.value, ConnectTimedOut)

    run(echo_forever, test)


def test_no_answer_in_time_and_a_connection_lost_mid_answer_are_failures_that_close_it() -> None:
    async def handler(reader, writer) -> None:
        await read_request(reader)
        await asyncio.sleep(0.6)  # longer than the read timeout
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.close()

    async def test(url: str, connections: list) -> None:
        upstream = client(read_timeout_s=0.3)
        with pytest.raises(TimedOut):
            await upstream.post(url, "/generate", b"{}", {})
        with pytest.raises(TransportFailed):
            await upstream.post(url, "/generate", b"{}", {})
        assert len(connections) == 2  # the timed-out connection was not used again

    run(handler, test)


def test_a_cancelled_request_closes_its_connection_so_the_engine_sees_the_client_leave() -> None:
    seen_eof: list[bool] = []

    async def handler(reader, writer) -> None:
        await read_request(reader)
        seen_eof.append(await reader.read() == b"")  # the client end closed while the request was in flight

    async def test(url: str, connections: list) -> None:
        task = asyncio.ensure_future(client().post(url, "/generate", b"{}", {}))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)
        assert seen_eof == [True]

    run(handler, test)


def test_idle_connections_past_the_keep_alive_are_not_reused() -> None:
    async def test(url: str, connections: list) -> None:
        upstream = client(keepalive_s=0.1)
        await upstream.post(url, "/generate", b"1", {})
        await asyncio.sleep(0.3)
        await upstream.post(url, "/generate", b"2", {})
        assert len(connections) == 2

    run(echo_forever, test)
