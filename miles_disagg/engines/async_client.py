"""The engine port on an event loop: :class:`AsyncEngineClient`, the lifecycle calls of
:class:`~miles_disagg.engines.client.EngineClient` as coroutines over one shared
:class:`~miles_disagg.net.pooled_http.PooledSession`.

Why: a weight update fans out to every engine at once. With a thread and an httpx client per engine,
256 engines cost about 1,500 synchronous requests contending for the GIL (``miles-disagg bench scale``:
1.56 s against 0.20 s for 8 engines, pauses 0.68 s against 0.08 s); one event loop sends them at a
fraction of the CPU. Errors are typed exactly as :class:`~miles_disagg.engines.client.EngineClient`'s
(the same status mapping, the same ``success: false`` check).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from miles_disagg.weights.location import normalize_store
from miles_disagg.engines.activation import ACTIVATE_PATH, offers_one_call
from miles_disagg.net.auth import ApiKeys
from miles_disagg.engines.client import CONTROL_TIMEOUT_S, PULL_TIMEOUT_S, error_for
from miles_disagg.net.keyed_client import payload_message, response_payload
from miles_disagg.net.pooled_http import PooledSession, Reply, TransportFailed
from miles_disagg.types import EngineUnreachable


class AsyncEngineClient:
    """One engine, reached through ``session`` (shared by the engines of one fan-out)."""

    def __init__(self, url: str, session: PooledSession, *, store_dir: str | Path | None = None,
                 local_checkpoint_dir: str | Path | None = None, keys: ApiKeys | None = None):
        self.url = url.rstrip("/")
        self.session = session
        self.keys = keys if keys is not None else ApiKeys.from_env()
        self.store_dir = normalize_store(store_dir) if store_dir is not None else None
        self.local_dir = os.path.abspath(local_checkpoint_dir) if local_checkpoint_dir is not None else None
        self.one_call_activation = False  # the last pull's answer announced /activate_weights
        self.last_pull: dict[str, Any] = {}  # the last /pull_weights answer (its region and transfer counts)

    async def pull(self, version: int) -> dict[str, Any]:
        body = {"target_version": version, "source_dir": self._need("store_dir"),
                "local_checkpoint_dir": self._need("local_dir")}
        answer = await self.call("POST", "/pull_weights", body, timeout_s=PULL_TIMEOUT_S)
        self.one_call_activation = offers_one_call(answer)
        self.last_pull = answer
        return answer

    async def activate_in_one_call(self, version: int, pause_mode: str, flush: bool) -> dict[str, Any]:
        """``/activate_weights``: the engine pauses, loads the prepared ``version``, continues and checks."""
        return await self.call("POST", ACTIVATE_PATH, {"model_path": self._need("local_dir"),
                                                       "weight_version": str(version), "pause_mode": pause_mode,
                                                       "flush_cache": flush})

    async def pause(self, mode: str) -> None:
        await self.call("POST", "/pause_generation", {"mode": mode})

    async def flush(self) -> None:
        await self.call("POST", "/flush_cache", {})

    async def load(self, version: int) -> None:
        await self.call("POST", "/update_weights_from_disk",
                        {"model_path": self._need("local_dir"), "weight_version": str(version)})

    async def resume(self) -> None:
        await self.call("POST", "/continue_generation", {})

    async def version(self) -> int | None:
        from miles_disagg.router.registry import parse_version

        return parse_version((await self.call("GET", "/model_info")).get("weight_version"))

    async def call(self, method: str, path: str, body: dict | None = None, *,
                   timeout_s: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        """One request; the JSON answer (a dict) or the typed error EngineClient raises for it."""
        return self.checked(await self.send(method, path, body, timeout_s=timeout_s), path)

    async def send(self, method: str, path: str, body: dict | None = None, *,
                   timeout_s: float = CONTROL_TIMEOUT_S) -> Reply:
        """One request, its answer whatever the status; ``EngineUnreachable`` when none came."""
        headers = self.keys.headers_for(path)
        try:
            if method == "GET":
                return await self.session.get(self.url + path, headers=headers, timeout_s=timeout_s)
            return await self.session.post(self.url + path, json=body, headers=headers, timeout_s=timeout_s)
        except TransportFailed as exc:
            raise EngineUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc

    def checked(self, reply: Reply, path: str) -> dict[str, Any]:
        """``reply``'s JSON answer (a dict) when it is a success, else the typed error EngineClient raises."""
        payload = response_payload(reply)
        if reply.status_code == 200 and not (isinstance(payload, dict) and payload.get("success") is False):
            return payload if isinstance(payload, dict) else {"result": payload}
        raise error_for(f"{self.url}{path} answered {reply.status_code}: {payload_message(payload)}",
                        reply.status_code, path)

    def _need(self, attr: str) -> str:
        value = getattr(self, attr)
        if value is None:
            raise ValueError(f"AsyncEngineClient({self.url}) was made without {attr}")
        return value
