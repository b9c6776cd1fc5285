"""A small synchronous client for one engine's SGLang-style control API.

Every call checks the HTTP status and the ``success`` field SGLang puts in weight-update
answers; a refusal raises ``EngineRequestFailed`` naming the engine, the endpoint and the
engine's message, so no failure is ever mistaken for success.
"""

from __future__ import annotations

from typing import Any

from miles_disagg.types import ReplaceReplica

CONTROL_TIMEOUT_S = 600.0


class EngineRequestFailed(ReplaceReplica):
    """An engine refused or failed a control request (or could not be reached)."""


class EngineClient:
    def __init__(self, url: str, timeout_s: float = CONTROL_TIMEOUT_S):
        import httpx

        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def call(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        import httpx

        try:
            response = self._http.request(method, path, json=body) if body is not None else self._http.request(method, path)
        except httpx.HTTPError as exc:
            raise EngineRequestFailed(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        try:
            payload = response.json()
        except ValueError:
            payload = {"message": response.text[:500]}
        if response.status_code != 200 or (isinstance(payload, dict) and payload.get("success") is False):
            message = payload.get("message") or payload.get("error") if isinstance(payload, dict) else payload
            raise EngineRequestFailed(f"{self.url}{path} answered {response.status_code}: {message}")
        return payload if isinstance(payload, dict) else {"result": payload}

    def post(self, path: str, body: dict | None = None) -> dict[str, Any]:
        return self.call("POST", path, body or {})

    def get(self, path: str) -> dict[str, Any]:
        return self.call("GET", path)

    def weight_version(self) -> str:
        return str(self.get("/get_weight_version")["weight_version"])

    def healthy(self) -> bool:
        try:
            self.get("/health")
            return True
        except EngineRequestFailed:
            return False

    def close(self) -> None:
        self._http.close()
