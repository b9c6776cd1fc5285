"""An engine's side of its region's relay (``miles-disagg relay``): objects by HTTP on the region's network.

``GET {relay}/objects/{key}`` answers an object's bytes (the relay pulls it from the object store
the first time any engine of the region asks, once, and keeps it); its ``X-Miles-Relay-Source``
header says whether this answer crossed the WAN for it (``store``) or came from the relay's cache
(``cache``). The caller checks what it got against the manifest exactly as an object from the
store. Standard library only (this room imports no HTTP framework); the key is the API key of
the environment (the run hands its keys to everything it starts).
"""

from __future__ import annotations

import http.client
import os
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from miles_disagg.net.auth import ApiKeys

RELAY_SOURCE_HEADER = "X-Miles-Relay-Source"
READ_BYTES = 1024 * 1024
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 30.0  # a relay slower than this between two reads is given up for the store


class RelayFailed(Exception):
    """The relay did not deliver the object (down, slow, refused, short): pull it from the store instead."""


@dataclass(frozen=True)
class RelayAnswer:
    nbytes: int
    crossed_wan: bool  # the relay pulled it from the store for this request (its one WAN copy)


class RelayClient:
    def __init__(self, url: str, keys: ApiKeys | None = None, read_timeout_s: float = READ_TIMEOUT_S):
        parts = urlsplit(url)
        self.url, self.https = url.rstrip("/"), parts.scheme == "https"
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or (443 if self.https else 80)
        self.keys = keys if keys is not None else ApiKeys.from_env()
        self.read_timeout_s = read_timeout_s

    def download(self, key: str, dest_fd: int, size: int) -> RelayAnswer:
        """The object ``key`` (the bucket's key) into ``dest_fd`` from offset 0; ``RelayFailed`` otherwise."""
        path = f"/objects/{quote(key, safe='/')}"
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=CONNECT_TIMEOUT_S)
        try:
            conn.connect()
            conn.sock.settimeout(self.read_timeout_s)
            conn.request("GET", path, headers=self.keys.headers_for(path))
            response = conn.getresponse()
            if response.status != 200:
                raise RelayFailed(f"{self.url} answered {response.status} for {key}")
            written = _copy(response, dest_fd, size)
            if written != size:
                raise RelayFailed(f"{self.url} sent {written} bytes of {key}, the manifest says {size}")
            return RelayAnswer(written, response.getheader(RELAY_SOURCE_HEADER) == "store")
        except RelayFailed:
            raise
        except (OSError, http.client.HTTPException) as exc:
            raise RelayFailed(f"{self.url}: {type(exc).__name__}: {exc}") from None
        finally:
            conn.close()


def _copy(response: http.client.HTTPResponse, fd: int, limit: int) -> int:
    """Stream the body into ``fd``, at most ``limit + 1`` bytes (more is a wrong object)."""
    offset = 0
    while offset <= limit:
        chunk = response.read(min(READ_BYTES, limit + 1 - offset))
        if not chunk:
            break
        os.pwrite(fd, chunk, offset)
        offset += len(chunk)
    return offset
