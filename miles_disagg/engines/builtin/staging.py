"""Staged weights: materialize a published version while serving, activate it in a short pause.

``/pull_weights`` runs :meth:`Stager.pull` on a worker thread (never the event loop, never
the scheduler thread): the weights package's ``Materializer`` applies and verifies the
version into the host-local checkpoint, then the tensors the activation needs are read
into RAM in the live dtype/device. Only the tensors that changed are read when the
prepared version's ``previous`` is exactly the live version; otherwise all of them.

Activation (:meth:`Stager.take` on the scheduler thread) hands the staged tensors over for
a pointer swap, so the pause does no disk read. A staged delta is used only while the
live version is still the one it was staged against; otherwise the caller reloads
from disk. A failed pull (checksum, lineage, layout) leaves both the live weights and any
previously staged version untouched.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from miles_disagg.engines.builtin.model_runner import ModelRunner
from miles_disagg.types import VersionRef


@dataclass
class StagedVersion:
    """Tensors of one prepared version, ready to be swapped in."""

    ref: VersionRef
    path: Path
    tensors: dict[str, torch.Tensor]
    applies_onto: VersionRef | None  # None: ``tensors`` hold every parameter
    prepare_s: float
    load_s: float
    transfer: dict = field(default_factory=dict)  # an object store's pull: bytes by source

    def summary(self) -> dict:
        return {
            "target_version": self.ref.version,
            "run_id": self.ref.run_id,
            "path": str(self.path),
            "num_tensors_staged": len(self.tensors),
            "staged_bytes": sum(t.numel() * t.element_size() for t in self.tensors.values()),
            "full": self.applies_onto is None,
            "prepare_ms": round(self.prepare_s * 1e3, 3),
            "load_ms": round(self.load_s * 1e3, 3),
            "transfer": self.transfer,
        }


class Stager:
    """Holds at most one staged version; tracks which published version is live."""

    def __init__(self, runner: ModelRunner, base_dir: Path, live_ref: VersionRef | None, *,
                 pre_read_hook: Callable[[str, int], None] | None = None):
        self.runner = runner
        self.pre_read_hook = pre_read_hook
        self.base_dir = Path(base_dir)
        self.live_ref = live_ref  # None when the live weights are not a known published version
        self.staged: StagedVersion | None = None
        self._pull_lock = threading.Lock()  # one pull at a time
        self._state_lock = threading.Lock()

    def pull(self, source_dir: str | Path, target_version: int, local_checkpoint_dir: Path) -> StagedVersion:
        """Materialize, verify and stage ``target_version`` (blocking; call off the event loop)."""
        from miles_disagg.weights.materializer import Materializer

        with self._pull_lock:
            start = time.perf_counter()
            materializer = Materializer(
                Path(local_checkpoint_dir), base_dir=self.base_dir, pre_read_hook=self.pre_read_hook, num_workers=2,
            )
            prepared = materializer.prepare(source_dir, target_version)
            prepared_at = time.perf_counter()
            with self._state_lock:
                live = self.live_ref
            delta_ok = prepared.previous is not None and _same_version(prepared.previous, live)
            names = list(prepared.changed) if delta_ok else None
            tensors = self.runner.load_tensors(Path(prepared.path), names)
            staged = StagedVersion(
                ref=prepared.ref, path=Path(prepared.path), tensors=tensors,
                applies_onto=live if delta_ok else None,
                prepare_s=prepared_at - start, load_s=time.perf_counter() - prepared_at, transfer=prepared.transfer,
            )
            with self._state_lock:
                self.staged = staged
            return staged

    def take(self, weight_version: str | None) -> StagedVersion | None:
        """The staged version named ``weight_version`` if it can be activated now, else None."""
        with self._state_lock:
            staged = self.staged
            if staged is None or weight_version is None or weight_version != str(staged.ref.version):
                return None
            if staged.applies_onto is not None and not _same_version(staged.applies_onto, self.live_ref):
                return None
            self.staged = None
            return staged

    def set_live(self, ref: VersionRef | None) -> None:
        with self._state_lock:
            self.live_ref = ref

    def staged_version(self) -> int | None:
        with self._state_lock:
            return None if self.staged is None else self.staged.ref.version


def _same_version(a: VersionRef | None, b: VersionRef | None) -> bool:
    """Same version number and run (an empty run id, the engine's start-up base, matches any run)."""
    if a is None or b is None or a.version != b.version:
        return False
    return not a.run_id or not b.run_id or a.run_id == b.run_id


def version_ref_from_string(version: str | None, run_id: str = "") -> VersionRef | None:
    """The engine's version string as a ``VersionRef`` when it is a decimal int, else None."""
    if version is None or not version.isdigit():
        return None
    return VersionRef(run_id, int(version))
