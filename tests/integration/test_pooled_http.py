"""``pooled_http.PooledSession``: replies read whole, and transport failures typed by what the
caller must do (nothing sent: ``NotConnected``; maybe sent: ``TransportFailed``)."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_disagg.net.pooled_http import NotConnected, PooledSession, TransportFailed
from miles_disagg.net.process import free_port


async def _serve(handler) -> tuple[asyncio.AbstractServer, str]:
    port = free_port()
    server = await asyncio.start_server(handler, "127.0.0.1", port)
    return server, f"http://127.0.0.1:{port}"


async def _answer_json(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    body = json.loads(await reader.readexactly(length))
    answer = json.dumps({"echo": body, "auth": b"authorization: bearer k" in head.lower()})
    writer.write(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 3\r\n"
                 + f"Content-Length: {len(answer)}\r\n\r\n{answer}".encode())
    await writer.drain()
    writer.close()


async def _hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.transport.abort()


def test_a_reply_has_status_headers_and_json_and_the_session_headers_go_out() -> None:
    async def main() -> None:
        server, url = await _serve(_answer_json)
        session = PooledSession(max_connections=4, connect_timeout_s=5, read_timeout_s=5,
                                headers={"Authorization": "Bearer k"})
        try:
            reply = await session.post(url + "/generate", json={"input_ids": [1, 2]})
        finally:
            await session.aclose()
            server.close()
        assert reply.status_code == 429 and not reply.is_success
        assert reply.headers.get("retry-after") == "3"
        assert reply.json() == {"echo": {"input_ids": [1, 2]}, "auth": True}
        assert json.loads(reply.text) == reply.json()

    asyncio.run(main())


def test_a_closed_port_is_not_connected_and_a_hang_up_is_a_transport_failure() -> None:
    async def main() -> None:
        session = PooledSession(max_connections=None, connect_timeout_s=5, read_timeout_s=5)
        server, url = await _serve(_hang_up)
        try:
            with pytest.raises(NotConnected, match="cannot connect"):
                await session.post(f"http://127.0.0.1:{free_port()}/generate", json={})
            with pytest.raises(TransportFailed) as failed:
                await session.post(url + "/generate", content=b"{}")
            assert not isinstance(failed.value, NotConnected)
        finally:
            await session.aclose()
            server.close()

    asyncio.run(main())
