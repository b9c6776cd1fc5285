"""The relay's object cache: each object of the store pulled once, however many engines ask.

Keys are a version's objects only (``<prefix>/weight_vNNNNNN/<attempt>/<file>``, and the base's
``<prefix>/base/<attempt>/<file>``, never evicted): immutable once
written, so a cached copy never goes stale (``LATEST``, the one object that changes, is never
relayed: engines read it from the store). Concurrent requests for one object wait for the one pull
(single flight); the request that started it is told its bytes crossed the WAN, the others that
they came from the cache. The cache keeps the newest ``max_versions`` versions' objects and deletes
older ones. The relay checks nothing against a manifest: every engine checks what it receives.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.types import InvalidInput
from miles_disagg.weights.location import ObjectLocation
from miles_disagg.weights.s3_client import ObjectClient

_RELATIVE = re.compile(r"^(?:weight_v(\d{6,9})|base)/[0-9a-f]{12,32}/[A-Za-z0-9._\-]{1,200}$")  # base: version 0
DEFAULT_MAX_VERSIONS = 8


@dataclass(frozen=True)
class Served:
    path: Path
    nbytes: int
    crossed_wan: bool  # this request's pull brought it across the WAN


class RelayCache:
    def __init__(self, location: ObjectLocation, cache_dir: Path, client: ObjectClient | None = None,
                 max_versions: int = DEFAULT_MAX_VERSIONS):
        self.location, self.cache_dir = location, Path(cache_dir)
        self.client = client or ObjectClient(location)
        self.max_versions = max(1, max_versions)
        self._lock = threading.Lock()
        self._inflight: dict[str, threading.Event] = {}
        self.wan_bytes_by_version: dict[int, int] = {}
        self.num_pulls = self.num_hits = 0

    def relative_key(self, key: str) -> tuple[str, int]:
        """``key`` (a bucket key) as a version object's relative key and its version; ``InvalidInput``
        for anything else (``LATEST``, another prefix, a path that climbs)."""
        relative = self.location.relative(key)
        match = _RELATIVE.match(relative)
        if match is None or ".." in relative:
            raise InvalidInput(f"{key[:200]!r} is not an object of a version under {self.location.display}")
        return relative, int(match.group(1) or 0)

    def get(self, key: str) -> Served:
        """The object's local copy, pulled first if needed (one pull per object, however many ask)."""
        relative, version = self.relative_key(key)
        path = self.cache_dir / relative
        while True:
            with self._lock:
                if path.is_file():
                    self.num_hits += 1
                    return Served(path, path.stat().st_size, False)
                waiting = self._inflight.get(relative)
                if waiting is None:
                    self._inflight[relative] = threading.Event()
                    break
            waiting.wait()
            if not path.is_file():  # the pull we waited for failed: try it ourselves
                continue
        try:
            size = self._pull(key, path)
        finally:
            with self._lock:
                self._inflight.pop(relative).set()
        with self._lock:
            self.num_pulls += 1
            self.wan_bytes_by_version[version] = self.wan_bytes_by_version.get(version, 0) + size
        self._evict(version)
        return Served(path, size, True)

    def _pull(self, key: str, path: Path) -> int:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.part"
        try:
            size = self.client.download_any(key, tmp)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return size

    def _evict(self, newest: int) -> None:
        """Keep the newest ``max_versions`` versions' directories."""
        with self._lock:
            versions = sorted((int(p.name[len("weight_v"):]), p) for p in self.cache_dir.glob("weight_v*")
                              if p.name[len("weight_v"):].isdigit())
            doomed = [p for v, p in versions[:-self.max_versions] if v < newest]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)

    def stats(self) -> dict:
        with self._lock:
            return {"num_pulls": self.num_pulls, "num_hits": self.num_hits, "num_in_flight": len(self._inflight),
                    "wan_bytes_by_version": {str(v): n for v, n in sorted(self.wan_bytes_by_version.items())}}
