"""Open a version store from its text: a directory, or an ``s3://`` URL (:mod:`location`).

An object store is read through a host-local mirror (:mod:`object_store`): ``cache_dir`` when the
caller has one (a materializer: beside its slots), else ``$MILES_DISAGG_STORE_CACHE`` or
``~/.cache/miles-disagg/stores``, one directory per store URL.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from miles_disagg.weights.location import is_url, parse_object_url
from miles_disagg.weights.store import VersionStore

CACHE_ENV = "MILES_DISAGG_STORE_CACHE"


def default_cache_dir(url: str) -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "miles-disagg", "stores")
    return Path(root) / hashlib.sha256(url.encode()).hexdigest()[:16]


def open_store(text: str | os.PathLike, cache_dir: str | Path | None = None, flag: str = "store") -> VersionStore:
    """The store ``text`` names (``InvalidInput`` for a URL of another scheme or a malformed one)."""
    raw = os.fspath(text)
    if not is_url(raw):
        return VersionStore(raw)
    from miles_disagg.weights.object_store import ObjectVersionStore

    location = parse_object_url(raw, flag)
    return ObjectVersionStore(location, cache_dir if cache_dir is not None else default_cache_dir(location.store_url))
