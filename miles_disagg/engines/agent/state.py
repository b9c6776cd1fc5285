"""The agent's host state (:class:`Agent`): the version its local checkpoint holds, pulls into it, and
activations reading its slots. No HTTP here (the app is :mod:`miles_disagg.engines.agent.app`).

Why activations read the slot directory and not the ``local_checkpoint_dir`` symlink: the symlink
flips at the end of every pull, so an engine reading through it could mix two versions. The slot
that holds version N is only rewritten by the pull after next (the materializer writes the
inactive slot), and a pull waits while any activation still reads a slot other than the held one.
So a slot never changes while the engine reads it.

Ordering and failure contracts: one pull at a time; pulls are blocking (the app runs them on worker
threads, so its proxy keeps answering during a pull); a failed pull leaves the held version held.
The agent owns the local checkpoint directory: nothing else may write it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from miles_disagg.engines.activation import ONE_CALL_ANNOUNCEMENT
from miles_disagg.engines.builtin import control_bodies
from miles_disagg.engines.roots import OutsideRoots, WeightRoots
from miles_disagg.net.asgi_guard import ServerGuard
from miles_disagg.types import Forbidden, InvalidInput, Retryable, VersionRef

log = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_READER_WAIT_S = 600.0


class VersionNotPrepared(InvalidInput):
    """An activation named a version the agent does not hold (requested vs held)."""

    def __init__(self, requested: str, held: VersionRef | None):
        self.requested, self.held = requested, held
        holds = f"holds version {held.version} (run {held.run_id or '<none>'})" if held else "holds no version yet"
        super().__init__(f"weight_version {requested} is not prepared on this host: the agent {holds}; "
                         f"POST /pull_weights with target_version {requested} first")


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Settings of one agent process."""

    engine_url: str
    """Base URL of the engine this agent fronts, e.g. ``http://127.0.0.1:30000``."""
    local_checkpoint_dir: Path
    """Host-local checkpoint the agent materializes into (a symlink to the held slot)."""
    base_dir: Path | None = None
    """Version 0 (the base checkpoint); default: the engine's ``model_path``, read at the first pull."""
    pre_read_hook: str | Callable[..., Any] | None = None
    """``module:function`` called as ``hook(source_dir, target_version)`` before a pull reads a version."""
    store_dirs: tuple[str, ...] = ()
    """The version stores a pull may read (``--weight-store-dir``); none: every pull is refused."""
    region: str = ""
    """This host's region label, carried by pull answers (WAN bytes per region)."""
    lora_roots: tuple[str, ...] = ()
    """The directories ``/load_lora_adapter`` may name an adapter under (``--lora-root``); none: every load refused."""
    lora_base_dir: Path | None = None
    """A run's LoRA adapter chain (its version 0, ``--lora-base-dir``): pulls materialize adapter versions
    and activations load them into the engine beside the base (:mod:`miles_disagg.engines.agent.adapters`)."""
    lora_base_from_store: bool = False
    """With ``lora_base_dir``: version 0 is the object store's, fetched there by the first pull (``--lora-base-from-store``)."""
    lora_resident_versions: int = 2
    """With ``lora_base_dir``: the newest adapter versions kept loaded (``--lora-resident-versions``)."""
    guard: ServerGuard = field(default_factory=ServerGuard)
    """Keys the agent enforces (and sends to the engine) and its request-size limit."""
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    """How long a connection to the engine may take before the request fails with 502."""
    reader_wait_s: float = DEFAULT_READER_WAIT_S
    """How long a pull waits for activations still reading the slot it would rewrite (then 409)."""


class Agent:
    """The host state: what the local checkpoint holds, pulls, and activations reading slots."""

    def __init__(self, config: AgentConfig):
        from miles_disagg.weights.hooks import PRE_READ_FLAG, load_hook
        from miles_disagg.weights.materializer import Materializer

        self.config = config
        self.engine_url = config.engine_url.rstrip("/")
        self.local_dir = Path(os.path.abspath(config.local_checkpoint_dir))
        self.base_dir = Path(config.base_dir) if config.base_dir is not None else None
        self._hook = load_hook(config.pre_read_hook, PRE_READ_FLAG)  # ConfigError now, not at the first pull
        view = Materializer(self.local_dir, base_dir=self.local_dir)  # reads state.json only; never prepares
        held = view.held()
        self._held: tuple[VersionRef, Path] | None = (held, view.held_path()) if held is not None else None
        self._materializer: Any = None
        self.adapters = None  # a run's LoRA adapter versions (--lora-base-dir)
        if config.lora_base_dir is not None:
            from miles_disagg.engines.agent.adapters import AgentAdapters

            self.adapters = AgentAdapters(config.lora_base_dir, self.local_dir, config.lora_resident_versions,
                                          from_store=config.lora_base_from_store)
        self._cond = threading.Condition()
        self._reading: Counter[Path] = Counter()  # slot path -> activations reading it now
        self._pull_lock = threading.Lock()
        self.pulling: int | None = None
        self.last_pull: dict | None = None
        self.last_activation: dict | None = None
        self.last_error: str | None = None

    # ---------------------------------------------------------------- pulls

    def held(self) -> tuple[VersionRef, Path] | None:
        with self._cond:
            return self._held

    def pull(self, req: control_bodies.PullWeights) -> dict:
        """Materialize + verify ``req.target_version`` (blocking; run off the event loop).

        Waits (up to ``reader_wait_s``, then ``Retryable``) while an activation reads a slot
        other than the held one, since the pull may rewrite it. Raises the materializer's
        typed errors; on any error the held version stays held and loadable.
        """
        self._check_local_dir(req.local_checkpoint_dir)
        source = self.roots().source(req.source_dir)
        with self._pull_lock:
            self._wait_for_stale_readers()
            self.pulling = req.target_version
            start = time.perf_counter()
            try:
                if self.adapters is not None:
                    self.adapters.fetch_base(source)  # --lora-base-from-store: version 0 onto this node
                prepared = self._get_materializer().prepare(source, req.target_version)
            except OSError as exc:  # the paths named are unusable; nothing was activated
                unusable = InvalidInput(f"pull of version {req.target_version} failed: {type(exc).__name__}: {exc}")
                raise self._failed(req, unusable) from exc
            except Exception as exc:
                raise self._failed(req, exc)
            finally:
                self.pulling = None
            with self._cond:
                self._held = (prepared.ref, Path(prepared.path))
        self.last_pull = {
            "version": prepared.ref.version, "run_id": prepared.ref.run_id, "path": str(prepared.path),
            "previous_version": prepared.previous.version if prepared.previous else None,
            "num_changed_tensors": len(prepared.changed),
            "prepare_ms": round((time.perf_counter() - start) * 1e3, 3),
            "region": self.config.region, "transfer": prepared.transfer,
        }
        log.info("prepared %s at %s in %.1f ms", prepared.ref, prepared.path, self.last_pull["prepare_ms"])
        return {"success": True, "target_version": prepared.ref.version, **self.last_pull,
                "message": f"Prepared version {prepared.ref.version} at {prepared.path}; activate it with "
                           f"/activate_weights (or update_weights_from_disk) weight_version={prepared.ref.version}",
                "miles_disagg": ONE_CALL_ANNOUNCEMENT}  # the caller may activate it in one call

    def _failed(self, req: control_bodies.PullWeights, exc: Exception) -> Exception:
        failed = f"pull of version {req.target_version} failed: "
        self.last_error = str(exc) if str(exc).startswith(failed) else f"{failed}{type(exc).__name__}: {exc}"
        log.warning("%s", self.last_error)
        return exc

    def roots(self) -> WeightRoots:
        return WeightRoots.of(self.base_dir, self.config.store_dirs, self.local_dir)

    def _check_local_dir(self, given: str | None) -> None:
        if given and Path(os.path.abspath(given)) != self.local_dir:
            raise OutsideRoots(f"local_checkpoint_dir {given!r} is not this agent's ({str(self.local_dir)!r}); "
                               "the agent materializes only into the directory it was started with")

    def _wait_for_stale_readers(self) -> None:
        with self._cond:
            held_path = self._held[1] if self._held else None
            idle = self._cond.wait_for(
                lambda: all(p == held_path for p, n in self._reading.items() if n > 0), self.config.reader_wait_s)
            if not idle:
                busy = sorted(str(p) for p, n in self._reading.items() if n > 0 and p != held_path)
                raise Retryable(f"activations still read {busy}, which this pull would rewrite; retry the pull")

    def _get_materializer(self):
        from miles_disagg.weights.materializer import Materializer

        if self._materializer is None:
            base = self.adapters.base_dir if self.adapters is not None else self.base_dir  # the chain's version 0
            if base is None:
                raise InvalidInput("the base checkpoint is unknown (pass --base-dir)")
            self._materializer = Materializer(self.local_dir, base_dir=base, pre_read_hook=self._hook)
        return self._materializer

    def set_base_dir(self, model_path: str) -> None:
        """Use the engine's ``model_path`` as version 0; ``InvalidInput`` unless it is a local checkpoint."""
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise InvalidInput(f"the engine's model_path {model_path!r} is not a local checkpoint directory "
                               "on this host; start the agent with --base-dir")
        self.base_dir = path

    # ---------------------------------------------------------------- activations

    def check_prepared(self, version: int) -> VersionRef:
        """The held version when it is ``version``; ``VersionNotPrepared`` otherwise (nothing is registered:
        a one-call activation checks this before it pauses the engine, then loads with :meth:`begin_activation`)."""
        held = self.held()
        if held is None or held[0].version != version:
            raise VersionNotPrepared(str(version), held[0] if held else None)
        return held[0]

    def begin_activation(self, weight_version: str | None) -> tuple[Path, VersionRef]:
        """The held slot for an activation of ``weight_version`` (None: of whatever is held),
        registered as being read until :meth:`end_activation`; ``VersionNotPrepared`` otherwise."""
        with self._cond:
            held = self._held
            if held is None or (weight_version is not None and int(weight_version) != held[0].version):
                raise VersionNotPrepared(weight_version if weight_version is not None else "<none>",
                                         held[0] if held else None)
            self._reading[held[1]] += 1
            return held[1], held[0]

    def end_activation(self, path: Path, ref: VersionRef, status_code: int | None, error: str | None) -> None:
        with self._cond:
            self._reading[path] -= 1
            if self._reading[path] <= 0:
                del self._reading[path]
            self._cond.notify_all()
        self.last_activation = {"version": ref.version, "run_id": ref.run_id, "path": str(path),
                                "engine_status": status_code, "error": error}
        if error:
            self.last_error = f"activation of version {ref.version} failed: {error}"

    def check_label(self, wanted: str | None, held: VersionRef) -> str:
        """The label an activation of ``held`` is forwarded with; ``Forbidden`` for any other."""
        if wanted is not None and wanted != str(held.version):
            raise Forbidden(f"the checkpoint loaded holds verified version {held.version}, not weight_version "
                            f"{wanted!r}; version labels come only from verified weights")
        return str(held.version)

    def names_local_checkpoint(self, model_path: str) -> bool:
        """True for the local checkpoint symlink or one of its slots (reads must go through the held slot)."""
        path = Path(os.path.abspath(model_path))
        slots = self.local_dir.parent / (self.local_dir.name + ".slots")
        return path == self.local_dir or path.parent == slots

    def info(self) -> dict:
        held = self.held()
        with self._cond:
            reading = sum(self._reading.values())
        return {
            "engine_url": self.engine_url,
            "local_checkpoint_dir": str(self.local_dir),
            "base_dir": str(self.base_dir) if self.base_dir else None,
            "held": {"run_id": held[0].run_id, "version": held[0].version, "path": str(held[1])} if held else None,
            "pulling": self.pulling,
            "num_activations_in_flight": reading,
            "last_pull": self.last_pull,
            "last_activation": self.last_activation,
            "last_error": self.last_error,
            "delta_filters": ["byteplane", "none"],  # what /pull_weights reads: a job may publish byte planes
            # the stores /pull_weights reads: a job attaching this agent must publish to one of them
            "weight_store_dirs": [str(d) for d in self.config.store_dirs],
            "region": self.config.region,
            **(self.adapters.info() if self.adapters is not None else {}),  # a run's LoRA adapter versions
            **ONE_CALL_ANNOUNCEMENT,  # /activate_weights: pause, flush, load, continue, check in one call
        }

    def checkpoint_checksums(self, algorithm: str) -> dict:
        """Checksums of the held local checkpoint's tensors: what this host handed its engine at
        the last activation (stock SGLang exposes no checksums of its live weights)."""
        from miles_disagg.weights.checksums import CHECKSUMS, checksum
        from miles_disagg.weights.safetensors_io import checkpoint_tensors, read_bytes

        if algorithm not in CHECKSUMS:
            raise InvalidInput(f"unknown checksum {algorithm!r} (known: {', '.join(CHECKSUMS)})")
        last = self.last_activation
        if last is not None and not last.get("error"):
            version, path = str(last["version"]), Path(last["path"])
        elif last is None and self.base_dir is not None:
            version, path = "0", Path(self.base_dir)  # never activated: the engine serves its base
        else:
            raise InvalidInput(f"the engine's weights are unknown: {self.last_error or 'no base directory known'}")
        sums = {name: checksum(algorithm, read_bytes(path / file, entry))
                for name, (file, entry) in checkpoint_tensors(path).items()}
        return {"weight_version": version, "algorithm": algorithm, "source": "local_checkpoint", "checksums": sums}
