"""The directories an engine host may read weights from and write checkpoints under.

A built-in engine or an agent is started with its roots: the base checkpoint (version 0),
the version store(s) it may pull from (``--weight-store-dir``) and the one host-local
checkpoint it materializes into (``--local-checkpoint-dir``, plus the materializer's
``<dir>.slots``). A request naming any other path is :class:`OutsideRoots` (HTTP 403) whose
message names the allowed roots; it is refused before anything is created, read or deleted.

Paths are compared after ``os.path.abspath`` (the local checkpoint is a symlink the
materializer flips, so it is never resolved) and, for the store and the base, after
``realpath`` as well, so ``..`` or a symlink cannot step outside. Pure apart from ``realpath``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.types import Forbidden
from miles_disagg.weights.location import is_url, normalize_store, parse_object_url

SLOTS_SUFFIX = ".slots"  # the materializer's A/B slot directory beside the local checkpoint


class OutsideRoots(Forbidden):
    """A path outside the directories this server was started with (403; nothing changed)."""


def _abs(path: str | Path) -> Path:
    return Path(os.path.abspath(os.fspath(path)))


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.fspath(path)))


@dataclass(frozen=True)
class WeightRoots:
    """See the module docstring. ``store_dirs`` empty or ``local_dir`` None: pulls are refused."""

    base_dir: Path | None
    store_dirs: tuple[str, ...] = ()  # directories (absolute) or object store URLs (canonical)
    local_dir: Path | None = None

    @classmethod
    def of(cls, base_dir: str | Path | None, store_dirs=(), local_dir: str | Path | None = None) -> "WeightRoots":
        return cls(_abs(base_dir) if base_dir else None, tuple(normalize_store(d, "--weight-store-dir") for d in store_dirs),
                   _abs(local_dir) if local_dir else None)

    def describe(self) -> str:
        stores = ", ".join(repr(str(d)) for d in self.store_dirs) or "none (--weight-store-dir not given)"
        local = repr(str(self.local_dir)) if self.local_dir else "none (--local-checkpoint-dir not given)"
        base = repr(str(self.base_dir)) if self.base_dir else "unknown"
        return f"base checkpoint {base}; version stores {stores}; local checkpoint {local}"

    def _refuse(self, what: str, path: str | Path) -> OutsideRoots:
        return OutsideRoots(f"{what} {str(path)!r} is outside this server's roots ({self.describe()})")

    def source(self, source_dir: str | Path) -> str:
        """The store a pull may read: exactly one of ``store_dirs`` (a URL must equal one in its
        canonical form; another scheme or a malformed URL is ``InvalidInput``)."""
        for store in self.store_dirs:
            if same_store(source_dir, store):
                return store
        raise self._refuse("source_dir", source_dir)

    def local(self, local_dir: str | Path | None) -> Path:
        """The local checkpoint a pull may write: exactly ``local_dir`` (None: that one)."""
        if self.local_dir is None:
            raise OutsideRoots(f"this server was started without --local-checkpoint-dir, so it writes no checkpoint "
                               f"({self.describe()})")
        if local_dir is not None and _abs(local_dir) != self.local_dir:
            raise self._refuse("local_checkpoint_dir", local_dir)
        return self.local_dir

    def slots_dir(self) -> Path | None:
        return None if self.local_dir is None else self.local_dir.parent / (self.local_dir.name + SLOTS_SUFFIX)

    def loadable(self, model_path: str | Path) -> str:
        """What ``model_path`` is: ``"base"``, ``"local"`` (the local checkpoint or one of its
        slots); anything else is ``OutsideRoots``."""
        path = _abs(model_path)
        if self.base_dir is not None and (path == self.base_dir or _real(path) == _real(self.base_dir)):
            return "base"
        slots = self.slots_dir()
        if self.local_dir is not None and (path == self.local_dir or (slots is not None and path.parent == slots)):
            return "local"
        raise self._refuse("model_path", model_path)


def inside_lora_roots(lora_path: str, roots) -> Path:
    """``lora_path`` (real path) when it lies under one of ``roots`` (``--lora-root``: the directories a
    LoRA adapter may be loaded from), else ``OutsideRoots`` naming them."""
    real = _real(lora_path)
    if not any(real == _real(root) or _real(root) in real.parents for root in roots):
        raise OutsideRoots(f"lora_path {lora_path!r} is outside this server's --lora-root directories "
                           f"({', '.join(repr(str(r)) for r in roots) or 'none given'})")
    return real


def same_store(a: str | Path, b: str | Path) -> bool:
    """Two store texts name one store: equal canonical URLs, or directories with one real path."""
    if is_url(a) or is_url(b):
        return is_url(a) and is_url(b) and parse_object_url(str(a)).store_url == parse_object_url(str(b)).store_url
    return _real(a) == _real(b)


LORA_BASE_SUFFIX = ".lora-v0"  # an engine's own copy of an adapter chain's version 0, beside its local checkpoint


def lora_base_from_store_dir(given: Path | None, local_checkpoint_dir: Path | None, stores) -> Path:
    """Where ``--lora-base-from-store`` fetches the adapter chain's version 0 on this node: ``given``
    (``--lora-base-dir``), else beside the local checkpoint; ``ValueError`` naming the flags when
    there is neither, or when no ``--weight-store-dir`` is an object store."""
    if not any(is_url(str(store)) for store in stores):
        raise ValueError("--lora-base-from-store needs an object store --weight-store-dir (s3://...): only an "
                         "object store holds the adapter chain's version 0")
    if given is not None:
        return Path(given)
    if local_checkpoint_dir is None:
        raise ValueError("--lora-base-from-store needs --local-checkpoint-dir (or --lora-base-dir): the adapter "
                         "chain's version 0 is fetched beside it")
    local = _abs(local_checkpoint_dir)
    return local.parent / f"{local.name}{LORA_BASE_SUFFIX}"
