"""API keys: who may call which endpoint of this project's servers, and what our clients send.

Two keys, SGLang's way (``--api-key``, ``--admin-api-key``, ``Authorization: Bearer <key>``):

* **open** endpoints (``/health``, ``/health_generate``, ``/agent_health``) answer anyone, so
  probes and load balancers need no secret;
* **admin** endpoints (:data:`ADMIN_PATHS`: weights, pause/continue, version labels, abort,
  worker registry, heartbeats, drain) take the admin key when one is set, else the API key
  when one is set, else anyone (SGLang's ``ADMIN_OPTIONAL``);
* every other endpoint takes the API key (or the admin key) when an API key is set, else anyone
  (SGLang leaves them open when only an admin key is set).

A wrong or missing key is a ``401`` with a JSON error and nothing changed. Keys are compared
in constant time. When a flag is not given, each server reads :data:`API_KEY_ENV` /
:data:`ADMIN_API_KEY_ENV` from its environment, so keys can stay out of ``ps``; a training
run generates its admin key and hands it to everything it starts through that variable.

Clients of ours send, per path, the key that path needs (:meth:`ApiKeys.headers_for`): the admin
key to admin paths, the API key to the others (the admin key when there is no API key: an
SGLang with only an admin key ignores it on its open endpoints and may still want it on some
it guards). A proxy (agent, router) forwards with at most the level its own caller proved
(:func:`forward_headers`), so an open or API-key endpoint of a proxy can never be used to
borrow the proxy's admin key.

Pure: no I/O beyond reading the environment, no heavy imports.
"""

from __future__ import annotations

import enum
import os
import secrets
from dataclasses import dataclass
from typing import Mapping

API_KEY_ENV = "MILES_DISAGG_API_KEY"
ADMIN_API_KEY_ENV = "MILES_DISAGG_ADMIN_API_KEY"
KEY_ENVS = (API_KEY_ENV, ADMIN_API_KEY_ENV)

OPEN_PATHS = frozenset({"/health", "/health_generate", "/agent_health"})

# Endpoints that change weights, versions, pausing, routing or membership (and SGLang's own
# admin endpoints, so the agent guards them in front of a stock SGLang too).
ADMIN_PATHS = frozenset({
    # engine weights and versions
    "/update_weights_from_disk", "/pull_weights", "/init_weights_update_group", "/update_weights_from_distributed",
    "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update", "/update_weight_version",
    "/update_weights_from_tensor", "/update_weights_from_ipc", "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance", "/load_lora_adapter", "/unload_lora_adapter",
    "/release_memory_occupation", "/resume_memory_occupation", "/set_internal_state",
    "/activate_weights",  # this project's one-call activation (pause, flush, load, continue, check)
    # pausing and aborting other clients' requests
    "/pause_generation", "/continue_generation", "/flush_cache", "/abort_request", "/start_profile", "/stop_profile",
    # router and gateway registry, replica control
    "/add_worker", "/remove_worker", "/set_worker_state", "/heartbeat", "/deregister", "/wake", "/drain",
})

BEARER = "bearer"


class AuthLevel(str, enum.Enum):
    OPEN = "open"
    NORMAL = "normal"
    ADMIN = "admin"


def level_of(path: str) -> AuthLevel:
    """What ``path`` requires (see the module docstring)."""
    if path in OPEN_PATHS:
        return AuthLevel.OPEN
    return AuthLevel.ADMIN if path in ADMIN_PATHS else AuthLevel.NORMAL


def new_key() -> str:
    """A fresh random key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() or None if scheme.lower() == BEARER else None


def _same(given: str | None, expected: str) -> bool:
    return given is not None and secrets.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True)
class ApiKeys:
    """One server's (or one client's) keys; ``None``: not set."""

    api_key: str | None = None
    admin_api_key: str | None = None

    def __post_init__(self) -> None:
        for name in ("api_key", "admin_api_key"):
            value = getattr(self, name)
            if value is not None and (not value.strip() or any(c.isspace() or not c.isprintable() for c in value)):
                raise ValueError(f"--{name.replace('_', '-')} must be non-empty printable text without spaces")

    @classmethod
    def resolve(cls, api_key: str | None = None, admin_api_key: str | None = None,
                environ: Mapping[str, str] | None = None) -> "ApiKeys":
        """Flag values where given, else :data:`API_KEY_ENV` / :data:`ADMIN_API_KEY_ENV` (an empty
        variable counts as unset)."""
        env = os.environ if environ is None else environ
        return cls(api_key if api_key is not None else (env.get(API_KEY_ENV) or None),
                   admin_api_key if admin_api_key is not None else (env.get(ADMIN_API_KEY_ENV) or None))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ApiKeys":
        return cls.resolve(environ=environ)

    @property
    def any(self) -> bool:
        return self.api_key is not None or self.admin_api_key is not None

    def env(self) -> dict[str, str]:
        """The environment variables that hand these keys to a child process."""
        return {name: value for name, value in ((API_KEY_ENV, self.api_key), (ADMIN_API_KEY_ENV, self.admin_api_key))
                if value is not None}

    # ------------------------------------------------------------------ server side

    def caller_level(self, path_level: AuthLevel, authorization: str | None) -> AuthLevel | None:
        """The level the caller proved for an endpoint of ``path_level``; None: refuse (401)."""
        token = bearer_token(authorization)
        is_admin = self.admin_api_key is not None and _same(token, self.admin_api_key)
        is_user = self.api_key is not None and _same(token, self.api_key)
        if path_level is AuthLevel.OPEN:
            return AuthLevel.ADMIN if is_admin else (AuthLevel.NORMAL if is_user else AuthLevel.OPEN)
        if path_level is AuthLevel.ADMIN:
            if self.admin_api_key is not None:
                return AuthLevel.ADMIN if is_admin else None
            if self.api_key is not None:
                return AuthLevel.ADMIN if is_user else None
            return AuthLevel.ADMIN  # no keys: an open server, as SGLang without keys
        if is_admin:
            return AuthLevel.ADMIN
        if self.api_key is not None:
            return AuthLevel.NORMAL if is_user else None
        return AuthLevel.NORMAL

    # ------------------------------------------------------------------ client side

    def header_for_level(self, level: AuthLevel, *, strict: bool = True) -> dict[str, str]:
        """``Authorization`` for a request needing ``level``: admin: the admin key (else the API key);
        normal: the API key (``strict=False``: else the admin key); open: none."""
        if level is AuthLevel.ADMIN:
            key = self.admin_api_key or self.api_key
        elif level is AuthLevel.NORMAL:
            key = self.api_key if strict else (self.api_key or self.admin_api_key)
        else:
            key = None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def headers_for(self, path: str) -> dict[str, str]:
        """What a client of ours sends to ``path`` (see the module docstring)."""
        return self.header_for_level(level_of(path.split("?", 1)[0]), strict=False)


def forward_headers(keys: ApiKeys, caller_level: AuthLevel | None, path: str) -> dict[str, str]:
    """A proxy's ``Authorization`` towards its upstream: the key ``path`` needs there, but never
    above the level the proxy's own caller proved (``caller_level``; None: unknown, the least)."""
    needed = level_of(path.split("?", 1)[0])
    proved = caller_level or AuthLevel.OPEN
    order = [AuthLevel.OPEN, AuthLevel.NORMAL, AuthLevel.ADMIN]
    return keys.header_for_level(min(needed, proved, key=order.index))
