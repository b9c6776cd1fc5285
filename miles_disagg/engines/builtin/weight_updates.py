"""Weight updates of the built-in engine: every way new weights reach the live model, and version labels.

Called from worker threads by the HTTP layer (through :class:`~miles_disagg.engines.builtin.runtime.Engine`'s
``updates``); anything that touches the live weights goes through ``Scheduler.call`` and so runs
between two decode steps.

Failure contract for every weight update: the new tensors are read and checked in full
before the swap, the swap is a pointer assignment per tensor, and the reported version
changes only after the swap; a failure anywhere leaves the live weights and version
as they were. Version labels come only from verified weights (the differences from SGLang this
makes are listed in :mod:`miles_disagg.engines.builtin.runtime`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, TypeVar

from miles_disagg.engines.activation import ONE_CALL_ANNOUNCEMENT
from miles_disagg.engines.builtin.config import EngineConfig
from miles_disagg.engines.builtin.dist_update import DistUpdater
from miles_disagg.engines.builtin.memory import WEIGHTS, MemoryReleased, MemoryState
from miles_disagg.engines.builtin.model_runner import ModelRunner
from miles_disagg.engines.builtin.control_bodies import (DistributedUpdate, InitGroup, PullWeights, UpdateFromDisk,
                                                         UpdateFromTensor)
from miles_disagg.engines.builtin.scheduler import Scheduler
from miles_disagg.engines.builtin.staging import Stager, version_ref_from_string
from miles_disagg.types import Forbidden, InvalidInput, VersionRef
from miles_disagg.weights.hooks import PRE_READ_FLAG, load_hook

log = logging.getLogger(__name__)

T = TypeVar("T")


class WeightUpdates:
    """Staged pulls, activations from disk, broadcast and in-memory updates, and the version label.

    ``weights_path``: the checkpoint directory the live weights were last loaded from."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, scheduler: Scheduler, memory: MemoryState):
        self.config, self.runner, self.scheduler, self.memory = config, runner, scheduler, memory
        self.stager = Stager(runner, config.model_path, version_ref_from_string(config.weight_version),
                             pre_read_hook=load_hook(config.pull_weights_pre_read_hook, PRE_READ_FLAG))
        self.dist = DistUpdater(runner.device)
        self.weights_path = Path(config.model_path)
        self.roots = config.roots()

    def set_version(self, version: str, abort_all: bool) -> None:
        """``/update_weight_version``: only the label the live weights verifiably hold (a no-op),
        unless ``--allow-unverified-versions``; ``Forbidden`` otherwise, nothing changed."""
        if not self.config.allow_unverified_versions:
            live = self.stager.live_ref
            if live is None or version != str(live.version):
                held = f"verified version {live.version}" if live else "of no verified version"
                raise Forbidden(f"relabelling the live weights ({held}) as {version!r} without loading them is "
                                "refused: version labels come only from verified weights; pull and activate the "
                                "version with /pull_weights + /update_weights_from_disk")

        def apply(s: Scheduler) -> None:
            if abort_all:
                s.abort_all("aborted by update_weight_version")
            s.version = version  # a label only: the stager keeps tracking what the weights are

        self.scheduler.call(apply).result()

    def update_from_disk(self, req: UpdateFromDisk) -> dict:
        """Activate the staged version named ``weight_version`` if there is one, else reload
        ``model_path`` from disk (read and checked in the pause, before anything is swapped).

        Everything runs on the scheduler thread, so the staged version is taken, checked
        against the live weights and swapped in with no other activation in between."""
        how: list[str] = []

        def activate(s: Scheduler, displaced: list) -> dict:
            start = time.perf_counter()
            tensors, live_ref, path, kind = self._weights_for(req)
            how.append(kind)
            num_paused = len(s.running) + len(s.waiting) if s.paused_mode else 0
            if req.abort_all_requests:
                s.abort_all("aborted by update_weights_from_disk(abort_all_requests=true)")
            self._swap(tensors, displaced)
            self.weights_path = path
            self.stager.set_live(live_ref)
            label = req.weight_version if req.weight_version is not None else _label_of(live_ref)
            if label is not None:
                s.version = label
            return {"num_paused_requests": num_paused, "pause_ms": round((time.perf_counter() - start) * 1e3, 3)}

        result = between_steps(self.scheduler, activate)
        log.info("activated weights (%s) version=%s pause=%.1f ms", how[0], self.scheduler.version, result["pause_ms"])
        return {
            "success": True,
            "message": f"Succeeded to update model weights ({how[0]} activation, pause {result['pause_ms']:.1f} ms).",
            "num_paused_requests": result["num_paused_requests"],
            "weight_version": self.scheduler.version,
            "activation": how[0],
            "pause_ms": result["pause_ms"],
        }

    def _weights_for(self, req: UpdateFromDisk) -> tuple[dict, VersionRef | None, Path, str]:
        """``(tensors, published version they are or None, path, "staged"|"disk")``; nothing live changes.

        The live weights' version (what a staged delta must apply onto) comes only from
        where the tensors came from: the staged version, the base (version 0), or the version
        the local checkpoint's last verified pull recorded; a version *label* never vouches for
        the weights. A path outside the roots is ``OutsideRoots`` (403)."""
        staged = self.stager.take(req.weight_version)
        if staged is not None:
            return staged.tensors, staged.ref, staged.path, "staged"
        kind = self.roots.loadable(req.model_path)
        if kind == "base":
            path, held = self.roots.base_dir, VersionRef("", 0)
        else:
            path, held = self._held_local()
        self._check_label(req.weight_version, held, path)
        self.runner.check_compatible(path)
        return self.runner.load_tensors(path), held, path, "disk"

    def _held_local(self) -> tuple[Path, VersionRef]:
        """The local checkpoint's held slot and version (``Forbidden`` when it holds none)."""
        from miles_disagg.weights.materializer import Materializer

        view = Materializer(self.roots.local_dir, base_dir=self.config.model_path)
        held, path = view.held(), view.held_path()
        if held is None or path is None:
            raise Forbidden(f"the local checkpoint {str(self.roots.local_dir)!r} holds no verified version yet; "
                            "POST /pull_weights first")
        return path, held

    def _check_label(self, wanted: str | None, held: VersionRef, path: Path) -> None:
        if wanted is None or wanted == str(held.version) or self.config.allow_unverified_versions:
            return
        raise Forbidden(f"model_path {str(path)!r} holds verified version {held.version}, not weight_version "
                        f"{wanted!r}; version labels come only from verified weights (pull {wanted} first)")

    def pull_weights(self, req: PullWeights) -> dict:
        """Materialize + verify + stage (blocking, off the scheduler thread); only from a
        ``--weight-store-dir`` into ``--local-checkpoint-dir`` (``OutsideRoots`` otherwise)."""
        source, local = self.roots.source(req.source_dir), self.roots.local(req.local_checkpoint_dir)
        versions = self.scheduler.lora.versions if self.scheduler.lora is not None else None
        if versions is not None:  # a run's LoRA adapter versions (engines/builtin/lora.py)
            return {**versions.pull(source, req.target_version, local, self.config.pull_weights_pre_read_hook),
                    "region": self.config.region, "miles_disagg": ONE_CALL_ANNOUNCEMENT}
        try:
            staged = self.stager.pull(source, req.target_version, local)
        except OSError as exc:  # the paths the caller named are unusable; nothing was staged or activated
            raise InvalidInput(f"pull of version {req.target_version} failed: {type(exc).__name__}: {exc}") from exc
        return {
            "success": True,
            "message": f"Prepared version {staged.ref.version}; activate it with /activate_weights "
                       "(or pause, update_weights_from_disk, continue)",
            **staged.summary(),
            "region": self.config.region,
            "miles_disagg": ONE_CALL_ANNOUNCEMENT,  # the caller may activate it in one call
        }

    def init_weights_update_group(self, req: InitGroup) -> dict:
        backend = self.dist.init_group(req)
        return {"success": True, "message": f"Succeeded to initialize group {req.group_name!r} ({backend})."}

    def destroy_weights_update_group(self, group_name: str) -> dict:
        self.dist.destroy_group(group_name)
        return {"success": True, "message": f"Succeeded to destroy group {group_name!r}."}

    def update_from_distributed(self, req: DistributedUpdate) -> dict:
        tensors = self.dist.receive(req, self.runner.named_weights())

        def activate(s: Scheduler, displaced: list) -> float:
            start = time.perf_counter()
            if req.abort_all_requests:
                s.abort_all("aborted by update_weights_from_distributed(abort_all_requests=true)")
            self._swap(tensors, displaced)
            if req.weight_version is not None:
                s.version = req.weight_version
            self.stager.set_live(None)  # broadcast weights are of no published version we can vouch for
            return (time.perf_counter() - start) * 1e3

        pause_ms = between_steps(self.scheduler, activate)
        return {"success": True, "message": "Succeeded to update parameter online.", "pause_ms": round(pause_ms, 3)}

    def update_from_tensor(self, req: UpdateFromTensor) -> dict:
        """Copy the named tensors the caller shares (CUDA IPC / shared memory) into the live weights."""
        from miles_disagg.engines.tensor_transfer import deserialize_named_tensors

        tensors, weights = {}, self.runner.named_weights()
        for name, tensor in deserialize_named_tensors(req.serialized_named_tensors[0]):
            tensors[name] = self._converted_copy(name, tensor, weights)

        def activate(s: Scheduler, displaced: list) -> None:
            if req.abort_all_requests:
                s.abort_all("aborted by update_weights_from_tensor(abort_all_requests=true)")
            self._swap(tensors, displaced)
            self.stager.set_live(None)  # weights handed over in memory are of no published version
            if req.weight_version is not None:
                s.version = req.weight_version

        between_steps(self.scheduler, activate)
        return {"success": True, "message": f"Succeeded to update {len(tensors)} tensors."}

    def _converted_copy(self, name: str, tensor, weights: dict):
        from miles_disagg.types import LayoutMismatch

        live = weights.get(name)
        if live is None:
            raise LayoutMismatch(f"tensor {name!r} is not a parameter of the live model")
        shape = self.memory.layouts[name].shape if name in self.memory.layouts else tuple(live.shape)
        if tuple(tensor.shape) != shape:
            raise LayoutMismatch(f"tensor {name!r} has shape {tuple(tensor.shape)}, the live model {shape}")
        return tensor.to(device=self.runner.device, dtype=live.dtype, copy=True).contiguous()

    def _swap(self, tensors: dict, displaced: list) -> None:
        """On the scheduler thread: make ``tensors`` live (nothing else happens in the pause but this
        and the bookkeeping of what is live); the displaced tensors go to ``displaced``."""
        self._check_weights_resident()
        self.scheduler.weights_changed()  # KV of the old weights never serves the new ones
        displaced.extend(self.runner.swap_in(tensors))
        self.memory.loaded(self.runner.live_names(tensors))

    def _check_weights_resident(self) -> None:
        if WEIGHTS in self.memory.released:
            raise MemoryReleased("the weights are released; POST /resume_memory_occupation with tags "
                                 "[\"weights\"] before loading weights")


def between_steps(scheduler: Scheduler, activate: Callable[[Scheduler, list], T]) -> T:
    """``activate(scheduler, displaced)`` on the scheduler thread between two steps; its result.

    ``activate`` swaps with :meth:`WeightUpdates._swap`, which puts the tensors the swap displaced in
    ``displaced``; they are released here, on the calling thread, once the scheduler moved on: giving
    hundreds of megabytes back to the OS took 10-330 ms of the pause when it happened inside the swap
    (``bench engine``'s staged pause on the 104M model, the first activations after start)."""
    displaced: list = []
    try:
        return scheduler.call(lambda s: activate(s, displaced)).result()
    finally:
        displaced.clear()  # the scheduler thread may still hold the command; the tensors go now, here


def _label_of(ref: VersionRef | None) -> str | None:
    return None if ref is None else str(ref.version)

