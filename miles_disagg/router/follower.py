"""One follower process of a router of several processes (started by :class:`~miles_disagg.router.group.RouterGroup`).

``python -m miles_disagg.router.follower --dir D --rank R --host H --port P --server-id ID --config JSON``:
binds ``H:P`` with ``SO_REUSEPORT`` beside the leader and serves, behind the same guard (keys from the
environment, ``--max-request-bytes``) and with the leader's server id:

* generation requests, routed by a :class:`~miles_disagg.router.proxy.Router` whose registry follows the
  leader's table (:class:`~miles_disagg.router.peers.FollowerPeers`; it never probes);
* everything else, passed on whole to the leader over its Unix socket, and its answer passed back (so the
  registry calls, ``/list_workers``, ``/health`` and ``/metrics`` have one answer whichever process a
  connection reached).

Every :data:`TICK_S` it applies the table (also when no request comes) and publishes its counters. It exits
when its control connection to the leader closes (the leader is gone: it then removes the shared directory
the leader could not), or on SIGTERM as any uvicorn server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from miles_disagg.net.asgi_guard import SERVER_ID_HEADER, GuardMiddleware, ServerGuard
from miles_disagg.net.auth import ApiKeys
from miles_disagg.router.config import RouterConfig
from miles_disagg.router.fast_path import GenerationFastPath
from miles_disagg.router.peers import FollowerPeers
from miles_disagg.router.proxy import Router
from miles_disagg.router.registry import WorkerRegistry
from miles_disagg.router.shared_table import PID, SERVING, SharedTable

log = logging.getLogger(__name__)
TICK_S = 0.1
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                        "upgrade", "host", "content-length"})
NOT_PASSED_BACK = HOP_BY_HOP | {"server", "date", SERVER_ID_HEADER}  # this process's server adds its own


class FollowerApp:
    """The follower's ASGI app (inside the guard): generation to the fast path, the rest to the leader."""

    def __init__(self, router: Router, table: SharedTable, rank: int, directory: Path, paths: dict):
        self.router, self.table, self.rank, self.directory = router, table, rank, directory
        self.fast_path = GenerationFastPath(self._to_leader, proxy=router.proxy, paths=paths)
        self.server = None  # the uvicorn server, told to exit when the leader is gone
        self.leader_gone = False
        self._session = None
        self._tasks: list[asyncio.Task] = []
        self._control: asyncio.StreamWriter | None = None

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self.fast_path(scope, receive, send)

    # ------------------------------------------------------------------ lifespan

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self._start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start(self) -> None:
        import aiohttp

        await self.router.start(probes=False)
        self.router.peers.sync()
        reader, self._control = await asyncio.open_unix_connection(str(self.directory / "control.sock"))
        self._control.write(json.dumps({"rank": self.rank}).encode() + b"\n")
        self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(self.directory / "leader.sock")),
                                              timeout=aiohttp.ClientTimeout(total=None, sock_read=600),
                                              cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)
        self.table.set_proc(self.rank, PID, float(os.getpid()))
        self.table.set_proc(self.rank, SERVING, 1.0)
        self._tasks = [asyncio.create_task(self._tick()), asyncio.create_task(self._leader_gone(reader))]

    async def _stop(self) -> None:
        self.table.set_proc(self.rank, SERVING, 0.0)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
        if self._control is not None:
            self._control.close()
        await self.router.stop()

    async def _tick(self) -> None:
        peers = self.router.peers
        while True:
            await asyncio.sleep(TICK_S)
            peers.sync()
            peers.publish_counters(self.router.counters)

    async def _leader_gone(self, reader: asyncio.StreamReader) -> None:
        await reader.read()  # the leader writes nothing: this returns when it closes the connection
        log.warning("router process %d: the leader is gone; exiting", self.rank)
        self.leader_gone = True
        if self.server is not None:
            self.server.should_exit = True

    def hint(self, message: dict) -> None:
        """Send news to the leader (see :class:`~miles_disagg.router.peers.FollowerPeers`)."""
        if self._control is not None and not self._control.is_closing():
            self._control.write(json.dumps(message).encode() + b"\n")

    # ------------------------------------------------------------------ passing on to the leader

    async def _to_leader(self, scope: dict, receive, send) -> None:
        import aiohttp

        body = []
        while True:
            message = await receive()
            body.append(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in HOP_BY_HOP]
        target = "http://router" + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        try:
            async with self._session.request(scope["method"], target, data=b"".join(body), headers=headers) as answer:
                content = await answer.read()
                status, raw = answer.status, answer.raw_headers
        except aiohttp.ClientError as exc:
            payload = json.dumps({"type": "LeaderUnreachable", "retryable": True,
                                  "message": f"the router's leader process did not answer: {exc}"}).encode()
            await _send_whole(send, 502, [(b"content-type", b"application/json")], payload)
            return
        await _send_whole(send, status, [(k, v) for k, v in raw if k.decode("latin-1").lower() not in NOT_PASSED_BACK],
                          content)


async def _send_whole(send, status: int, headers: list, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from miles_disagg.net.process import listen_socket
    from miles_disagg.router.app import generation_methods

    parser = argparse.ArgumentParser(prog="python -m miles_disagg.router.follower")
    for name in ("--dir", "--host", "--server-id", "--config"):
        parser.add_argument(name, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-request-bytes", type=int, required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s router[{args.rank}] %(levelname)s %(name)s: %(message)s")
    directory = Path(args.dir)
    config = RouterConfig(**json.loads(args.config))
    table = SharedTable.attach(directory / "table")
    registry = WorkerRegistry(failure_threshold=config.health_failure_threshold)
    guard = ServerGuard(ApiKeys.from_env(), max_request_bytes=args.max_request_bytes)
    app: FollowerApp | None = None
    peers = FollowerPeers(registry, table, args.rank, hint=lambda message: app.hint(message))
    router = Router(config, registry, guard.keys, peers=peers)
    router.server_id = args.server_id
    app = FollowerApp(router, table, args.rank, directory, generation_methods())
    sock = listen_socket(args.host, args.port, reuse_port=True)
    server = uvicorn.Server(uvicorn.Config(GuardMiddleware(app, guard=guard, server_id=args.server_id),
                                           log_level=args.log_level, proxy_headers=False, lifespan="on"))
    app.server = server
    server.run(sockets=[sock])
    if app.leader_gone:  # it cannot clean up after itself any more (killed): the shared directory goes now
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
