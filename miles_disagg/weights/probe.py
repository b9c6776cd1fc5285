"""Is the version store the same directory here as where the trainer writes it?

The store (``--update-weight-disk-dir``) is the one path a multi-node run shares: the trainer
writes versions there and every rollout host reads them at the same path. Before training,
the trainer's publishing rank writes a probe file with a fresh token into the store
(:func:`write_probe`); each engine's node then reads it back (:func:`read_probe`). A node that
cannot (no such directory, an empty local directory of the same name, no permission) is
named before any step runs, instead of failing its first weight update. Readers of the store
ignore the probe (its name is not a version directory) and the trainer removes it afterwards.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

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


def write_probe(store_dir: str | Path) -> StoreProbe:
    """Create the store directory if needed and write a probe into it (durably)."""
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


def remove_probe(probe: StoreProbe) -> None:
    try:
        probe.path.unlink()
    except FileNotFoundError:
        pass
