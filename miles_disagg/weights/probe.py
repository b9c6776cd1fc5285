"""Is the version store the same directory here as where the trainer writes it?

The store (``--update-weight-disk-dir``) is the one path a multi-node run shares: the trainer
writes versions there and every rollout host reads them at the same path. Before training,
the trainer's publishing rank writes a probe file with a fresh token into the store
(:func:`write_probe`); each engine's node then reads it back (:func:`read_probe`). A node that
cannot (no such directory, an empty local directory of the same name, no permission) is
named before any step runs, instead of failing its first weight update. Readers of the store
ignore the probe (its name is not a version directory) and the trainer removes it afterwards.

An object store (``s3://``) is probed the same way: the probe is an object under the store's prefix,
written by the trainer with its credentials and read back on every engine node with that node's,
so a node whose endpoint, credentials or bucket differ is named the same way.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.types import MilesDisaggError
from miles_disagg.weights.location import is_object_store

PROBE_PREFIX = ".store-probe-"


@dataclass(frozen=True)
class StoreProbe:
    """A probe file the trainer wrote: where, and what it holds."""

    store_dir: str
    name: str
    token: str

    @property
    def path(self) -> Path:
        return Path(self.store_dir) / self.name


def _object_client(store: str):
    from miles_disagg.weights.location import parse_object_url
    from miles_disagg.weights.s3_client import ObjectClient

    location = parse_object_url(store)
    return location, ObjectClient(location, attempts=3)


def write_probe(store_dir: str | Path) -> StoreProbe:
    """Create the store directory if needed and write a probe into it (durably)."""
    if is_object_store(store_dir):
        location, client = _object_client(str(store_dir))
        token = uuid.uuid4().hex
        probe = StoreProbe(location.url, f"{PROBE_PREFIX}{token[:12]}", token)
        client.put(location.key(probe.name), token.encode())
        return probe
    root = Path(store_dir)
    root.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    probe = StoreProbe(str(root.resolve()), f"{PROBE_PREFIX}{token[:12]}", token)
    with open(probe.path, "w") as f:
        f.write(token)
        f.flush()
        os.fsync(f.fileno())
    return probe


def read_probe(probe: StoreProbe) -> str | None:
    """None when this machine reads the probe back; otherwise what it found instead."""
    if is_object_store(probe.store_dir):
        return _read_object_probe(probe)
    root = Path(probe.store_dir)
    if not root.is_dir():
        return "no such directory"
    if not os.access(root, os.R_OK | os.X_OK):
        return "the directory is not readable"
    try:
        found = probe.path.read_text()
    except FileNotFoundError:
        return "the directory exists but is not the trainer's (the probe it wrote there is missing)"
    except OSError as exc:
        return f"cannot read it ({exc.strerror or exc})"
    return None if found == probe.token else "the probe file there holds another token (a different store)"


def _read_object_probe(probe: StoreProbe) -> str | None:
    try:
        location, client = _object_client(probe.store_dir)
        found = client.get(location.key(probe.name), 1024)
    except MilesDisaggError as exc:
        return f"cannot read it ({exc})"
    if found is None:
        return "the object store answers but the trainer's probe object is missing (another endpoint or bucket?)"
    return None if found[0].decode(errors="replace") == probe.token else "the probe object there holds another token"


def remove_probe(probe: StoreProbe) -> None:
    if is_object_store(probe.store_dir):
        location, client = _object_client(probe.store_dir)
        client.delete([location.key(probe.name)])
        return
    try:
        probe.path.unlink()
    except FileNotFoundError:
        pass
