"""Where a version store lives: a directory, or ``s3://bucket/prefix`` on an S3-compatible object store.

Every flag that takes a store (``--update-weight-disk-dir``, ``--weight-store-dir``, ``--store``)
takes either form. A text with ``://`` is a URL and never a path: ``s3://`` is the one scheme
served; any other (``gs://``, ``file://``, ``http://``) is refused with one line, so a URL is
never silently taken for a relative directory.

An object store URL may carry query parameters, so that every process a store string reaches
(an engine's argv, a ``/pull_weights`` body, a replica's command line) reaches the same endpoint:
``endpoint`` (an S3-compatible server: MinIO, R2, GCS's XML API; default: the AWS configuration's
``AWS_ENDPOINT_URL``), ``region``, and, on an engine's own ``--weight-store-dir`` only, ``relay``:
its region's ``miles-disagg relay``, which it pulls objects from before the store itself (two texts
that differ only in ``relay`` name the same store). Credentials never travel in a URL: they come from the
standard AWS configuration (environment, ``AWS_PROFILE``, the shared config files) of each process,
and a URL naming any other parameter is refused. Pure: no I/O.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, urlsplit

from miles_disagg.types import InvalidInput

OBJECT_SCHEME = "s3"
URL_PARAMETERS = ("endpoint", "region", "relay")
MAX_STORE_TEXT = 2048
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_PREFIX_PART = re.compile(r"^[A-Za-z0-9._\-=+]+$")


@dataclass(frozen=True)
class ObjectLocation:
    """An S3 bucket and key prefix (no leading or trailing slash; may be empty)."""

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    relay_url: str | None = None

    @property
    def url(self) -> str:
        """The canonical text of this location, its relay included."""
        return self._text(with_relay=True)

    @property
    def store_url(self) -> str:
        """The canonical text of the store itself (what engines compare their roots on: no relay)."""
        return self._text(with_relay=False)

    def _text(self, with_relay: bool) -> str:
        path = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket
        pairs = (("endpoint", self.endpoint_url), ("region", self.region), ("relay", self.relay_url if with_relay else None))
        query = [f"{k}={quote(v, safe=':/')}" for k, v in pairs if v]
        return f"{OBJECT_SCHEME}://{path}" + (f"?{'&'.join(query)}" if query else "")

    @property
    def display(self) -> str:
        """For messages: the bucket and prefix only."""
        return f"{OBJECT_SCHEME}://{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, name: str) -> str:
        """The object key of ``name`` (a relative key) under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def relative(self, key: str) -> str:
        """``key`` without the prefix (``InvalidInput`` when it is not under it)."""
        head = f"{self.prefix}/" if self.prefix else ""
        if not key.startswith(head):
            raise InvalidInput(f"object {key!r} is outside {self.display}")
        return key[len(head):]


def is_url(text: str | os.PathLike) -> bool:
    return "://" in os.fspath(text)


def is_object_store(text: str | os.PathLike | None) -> bool:
    return text is not None and os.fspath(text).startswith(f"{OBJECT_SCHEME}://")


def parse_object_url(text: str, flag: str = "store") -> ObjectLocation:
    """``s3://bucket[/prefix][?endpoint=URL&region=R]``; ``InvalidInput`` naming what is wrong."""
    if len(text) > MAX_STORE_TEXT:
        raise InvalidInput(f"{flag}: the store URL is {len(text)} characters, more than {MAX_STORE_TEXT}")
    parts = urlsplit(text)
    if parts.scheme != OBJECT_SCHEME:
        raise InvalidInput(f"{flag} {text[:200]!r}: the {parts.scheme}:// scheme is not a version store here: use a "
                           f"directory or {OBJECT_SCHEME}://bucket/prefix (GCS, R2, MinIO: through their S3 API, "
                           "with ?endpoint=URL or AWS_ENDPOINT_URL)")
    if parts.username or parts.password or "@" in parts.netloc:
        raise InvalidInput(f"{flag}: credentials never go in a store URL; use the AWS configuration "
                           "(AWS_PROFILE, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the shared config files)")
    if not _BUCKET.match(parts.netloc or ""):
        raise InvalidInput(f"{flag} {_shown(text)}: {parts.netloc!r} is not a valid bucket name")
    prefix = parts.path.strip("/")
    if prefix and not all(_PREFIX_PART.match(p) and p not in (".", "..") for p in prefix.split("/")):
        raise InvalidInput(f"{flag} {_shown(text)}: the prefix {prefix!r} may hold only letters, digits and ._-=+ "
                           "between single slashes")
    params = _parameters(parts.query, flag, text)
    return ObjectLocation(parts.netloc, prefix, params.get("endpoint"), params.get("region"), params.get("relay"))


def _parameters(query: str, flag: str, text: str) -> dict[str, str]:
    params: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if key not in URL_PARAMETERS:
            raise InvalidInput(f"{flag} {_shown(text)}: unknown URL parameter {key!r} (known: "
                               f"{', '.join(URL_PARAMETERS)}; credentials come from the AWS configuration)")
        if key in params or not value:
            raise InvalidInput(f"{flag} {_shown(text)}: parameter {key!r} is empty or given twice")
        params[key] = value
    for name in ("endpoint", "relay"):
        value = params.get(name)
        if value is None:
            continue
        scheme = urlsplit(value)
        if scheme.scheme not in ("http", "https") or not scheme.netloc or scheme.username or scheme.password \
                or scheme.path not in ("", "/"):
            raise InvalidInput(f"{flag} {_shown(text)}: {name} must be an http(s)://host[:port] URL without "
                               "credentials or a path")
        params[name] = value.rstrip("/")
    return params


def _shown(text: str) -> str:
    """A store text for messages: without its query (endpoints are not secret, but keep lines short)."""
    return repr(text.split("?", 1)[0][:200])


def normalize_store(text: str | os.PathLike, flag: str = "store") -> str:
    """The canonical form of a store: an absolute directory, or the URL as :attr:`ObjectLocation.url`.
    A URL of another scheme is refused (:func:`parse_object_url`)."""
    raw = os.fspath(text)
    if is_url(raw):
        return parse_object_url(raw, flag).url
    return os.path.abspath(raw)


def with_relay(store: str, relay_url: str | None) -> str:
    """An object store's text with ``relay_url`` as its relay (a directory, or no relay: unchanged)."""
    if not relay_url or not is_object_store(store):
        return store
    location = parse_object_url(store)
    return ObjectLocation(location.bucket, location.prefix, location.endpoint_url, location.region, relay_url).url


def store_display(text: str | os.PathLike) -> str:
    """A store for messages and records: a directory as given, a URL without its query."""
    raw = os.fspath(text)
    return parse_object_url(raw).display if is_object_store(raw) else raw
