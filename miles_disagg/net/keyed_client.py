"""The skeleton every client of our servers shares (engine, router, gateway): one base URL, a
bounded timeout, and the run's keys sent per path (the admin key only to admin endpoints)."""

from __future__ import annotations

import functools
from typing import Any

from miles_disagg.net.auth import ApiKeys

KEEPALIVE_EXPIRY_S = 2.0
"""Idle pooled connections are dropped after this long: before the 5 s after which uvicorn (our
servers, SGLang) closes an idle connection from its side, so a request never goes out on a
connection the server is closing (that reads as a random "connection reset by peer")."""


def pooled_limits(**kwargs: Any):
    """``httpx.Limits`` with :data:`KEEPALIVE_EXPIRY_S`; ``kwargs`` set the rest."""
    import httpx

    return httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S, **kwargs)


@functools.cache
def shared_tls_context():
    """httpx's default TLS context, made once per process and handed to every client made here
    (``verify=``): httpx builds a new one per client by loading the CA bundle, about 40 ms of CPU,
    and some clients are made per call (a health check, a status read)."""
    import httpx

    return httpx.create_ssl_context()


class KeyedHttpClient:
    """Subclasses add the endpoints; :meth:`request` sends one with the right key."""

    def __init__(self, url: str, *, timeout_s: float, keys: ApiKeys | None = None):
        """``keys``: None takes the environment's (every process of a run inherits its keys)."""
        import httpx

        self.url = url.rstrip("/")
        self.keys = keys if keys is not None else ApiKeys.from_env()
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, limits=pooled_limits(), trust_env=False,
                                  verify=shared_tls_context())

    def request(self, method: str, path: str, **kwargs: Any):
        """The raw ``httpx.Response`` (transport errors propagate as httpx's own)."""
        return self._http.request(method, path, headers=self.keys.headers_for(path), **kwargs)

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def response_payload(response) -> Any:
    """A response's JSON, or the start of its text where it is not JSON."""
    try:
        return response.json()
    except ValueError:
        return response.text[:500]


def payload_message(payload: Any) -> str:
    """The human message of an error payload: ``message``, ``error.message`` or ``error`` (SGLang,
    FastAPI and our servers each use one), else the payload itself."""
    if isinstance(payload, dict):
        error = payload.get("error")
        return str(payload.get("message") or (error.get("message") if isinstance(error, dict) else error) or payload)
    return str(payload)
