"""A session endpoint (:mod:`miles_disagg.rollout.sessions`) on an event loop of its own thread, in front
of a router, for tests that drive it over HTTP as an agent does."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from pathlib import Path
from typing import Iterator

from miles_disagg.models.tokenizer import load_tokenizer
from miles_disagg.net.auth import ApiKeys
from miles_disagg.rollout.sessions.agent import load_matcher
from miles_disagg.rollout.sessions.app import SessionServer
from miles_disagg.rollout.sessions.service import SessionService, SessionSettings
from miles_disagg.rollout.sessions.templates import checkpoint_template
from miles_disagg.rollout.sessions.tito import TitoRule


class SessionEndpoint:
    """The server, its service and the loop they run on (``call`` runs a coroutine there)."""

    def __init__(self, server: SessionServer, loop: asyncio.AbstractEventLoop):
        self.server, self.service, self.loop = server, server.service, loop

    @property
    def url(self) -> str:
        return self.server.url

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def session_endpoint(model_dir: Path, router_url: str, *, admin_key: str | None = None, model: str = "qwen3",
                     roles: tuple[str, ...] = ("tool", "user"), max_new_tokens: int = 8,
                     version_bound=lambda: (None, None), matcher: str = "strict") -> Iterator[SessionEndpoint]:
    import httpx

    tokenizer = load_tokenizer(model_dir)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rule = TitoRule.make(model, checkpoint_template(model_dir), encode, roles)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    client = None

    async def start() -> SessionServer:
        nonlocal client
        client = httpx.AsyncClient(timeout=120.0, trust_env=False)
        service = SessionService(client, router_url, rule, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                 SessionSettings({"temperature": 1.0}, max_new_tokens), version_bound, Counter(),
                                 load_matcher(matcher), stream_client=client)
        server = SessionServer(service, ApiKeys(admin_api_key=admin_key))
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield SessionEndpoint(server, loop)
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
