"""LoRA adapters on the built-in engine (``--enable-lora``): several resident at once, each request
choosing one by name (SGLang's ``lora_path``), a batch mixing them row by row.

The base model stays as it is. With ``--enable-lora`` every projection an adapter may target
(``q_proj`` ... ``down_proj``) gets one forward hook at start; a forward pass with no adapter in its
batch costs one Python call per projection. In a pass whose rows carry adapters (:meth:`LoraBank.rows`),
each adapter's rows get ``x @ A^T @ B^T * alpha / r`` added to the projection's output, as PEFT's
LoRA layer computes it.

Lifecycle of one adapter (SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter``): loading
reads a directory checked whole (:func:`~miles_disagg.weights.adapters.check_adapter_dir`) under the
engine's ``--lora-root`` directories while generation goes on; it is served as soon as it is
resident. A request holds its adapter from admission to its end (``in_flight``), so a request
finishes on the adapter it started with. Unloading never waits: the adapter takes no new request at
once and leaves when its in-flight count reaches zero. At most ``--max-loaded-loras`` are resident;
loading one more is refused (409) until one is unloaded.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from miles_disagg.engines.builtin.control_bodies import MAX_LORA_NAME_CHARS, LoadLoraAdapter, UnloadLoraAdapter
from miles_disagg.engines.roots import inside_lora_roots
from miles_disagg.types import InvalidInput, Retryable
from miles_disagg.weights.adapters import ADAPTER_WEIGHTS, AdapterInfo, check_adapter_dir

TARGETABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_NAME_CHARS = MAX_LORA_NAME_CHARS
MAX_STACKS = 256  # cached (module, adapters) rank stacks; cleared whole beyond


class LoraBankFull(Retryable):
    """``--max-loaded-loras`` adapters are resident (409: retry once one is unloaded); nothing changed."""


@dataclass
class ResidentAdapter:
    name: str
    path: str
    info: AdapterInfo
    pinned: bool
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [r, in], B [out, r])
    in_flight: int = 0
    unloading: bool = False
    key: str = field(default_factory=lambda: uuid.uuid4().hex)  # this load's identity (its prefix-cache partition)
    version: str | None = None  # a run's adapter version: what a request on it reports as its weight version
    sums: Callable[[str], dict] = lambda algorithm: {}  # a run's adapter version: its checksums as loaded, by PEFT name

    def describe(self) -> dict:
        return {"lora_name": self.name, "lora_path": self.path, "rank": self.info.rank, "lora_alpha": self.info.alpha,
                "target_modules": list(self.info.targets), "pinned": self.pinned, "in_flight": self.in_flight,
                "unloading": self.unloading}


@dataclass
class _Rows:
    """A forward pass's adapters (in order) and, where rows differ, each row's 0/1 mask over their
    stacked ranks ``[rows, 1, total rank]`` (None: every row runs the one adapter)."""

    adapters: tuple[ResidentAdapter, ...] = ()
    mask: torch.Tensor | None = None


def _batch_rows(row_adapters: list[ResidentAdapter | None]) -> _Rows:
    adapters: list[ResidentAdapter] = []
    for adapter in row_adapters:
        if adapter is not None and all(adapter is not a for a in adapters):
            adapters.append(adapter)
    if not adapters:
        return _Rows()
    if len(adapters) == 1 and all(a is adapters[0] for a in row_adapters):
        return _Rows(tuple(adapters))
    offsets, total = {}, 0
    for adapter in adapters:
        offsets[id(adapter)] = total
        total += adapter.info.rank
    mask = torch.zeros(len(row_adapters), 1, total)
    for row, adapter in enumerate(row_adapters):
        if adapter is not None:
            start = offsets[id(adapter)]
            mask[row, 0, start:start + adapter.info.rank] = 1
    return _Rows(tuple(adapters), mask)


class LoraBank:
    """The resident adapters of one model and the hooks that apply them; see the module docstring."""

    def __init__(self, model: torch.nn.Module, *, max_loaded: int, max_rank: int, roots: list[str]):
        self.max_loaded, self.max_rank = max_loaded, max_rank
        self.roots = list(roots)
        self._lock = threading.Lock()
        self._adapters: dict[str, ResidentAdapter] = {}
        self._rows = _Rows()
        self._stacks: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.served: str | None = None  # the adapter of requests that name none (adapter versions of a run)
        self.versions: AdapterVersions | None = None
        self.modules = {name: module for name, module in model.named_modules()
                        if name.rsplit(".", 1)[-1] in TARGETABLE and isinstance(module, torch.nn.Linear)}
        for name, module in self.modules.items():
            module.register_forward_hook(self._hook(name))

    # ------------------------------------------------------------------ load / unload

    def load(self, name: str, path: str, pinned: bool = False) -> dict:
        """Make adapter ``name`` resident from directory ``path`` (``InvalidInput``: malformed or not
        this model's, or the name is taken; ``Forbidden``: outside the roots; ``LoraBankFull``)."""
        if not name or len(name) > MAX_NAME_CHARS:
            raise InvalidInput(f"lora_name must be 1 to {MAX_NAME_CHARS} characters")
        return self.load_dir(name, inside_lora_roots(path, self.roots), pinned)

    def load_dir(self, name: str, directory: Path, pinned: bool = False, version: str | None = None) -> dict:
        """:meth:`load` of a directory the engine itself chose (its own materialized adapter versions)."""
        info = check_adapter_dir(directory)
        if info.rank > self.max_rank:
            raise InvalidInput(f"adapter {name!r} has rank {info.rank}, above --max-lora-rank {self.max_rank}")
        weights = self._read_weights(directory, info)
        with self._lock:
            if name in self._adapters:
                raise InvalidInput(f"a LoRA adapter named {name!r} is already loaded; unload it first or use another name")
            if len(self._adapters) >= self.max_loaded:
                raise LoraBankFull(f"{len(self._adapters)} LoRA adapters are resident, the most --max-loaded-loras allows; "
                               "unload one first")
            self._adapters[name] = ResidentAdapter(name, str(directory), info, pinned, weights, version=version,
                                                   sums=_file_checksums(directory) if version is not None
                                                   else (lambda algorithm: {}))
            return self._adapters[name].describe()

    def unload(self, name: str) -> dict:
        """Stop serving ``name`` now; it leaves once its in-flight requests finish (never waits)."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                raise InvalidInput(f"no LoRA adapter named {name!r} is loaded")
            if name == self.served:
                raise InvalidInput(f"{name!r} is the adapter served to requests that name none; activate another first")
            adapter.unloading = True
            if adapter.in_flight == 0:
                del self._adapters[name]
            return {"lora_name": name, "unloaded": name not in self._adapters, "in_flight": adapter.in_flight}

    def _read_weights(self, directory: Path, info: AdapterInfo) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        from safetensors.torch import load_file

        tensors = load_file(str(directory / ADAPTER_WEIGHTS))
        weights = {}
        for module in info.modules:
            layer = self.modules.get(module.module)
            if layer is None or (layer.in_features, layer.out_features) != (module.in_features, module.out_features):
                raise InvalidInput(f"adapter at {str(directory)!r} adapts {module.module} "
                                   f"[{module.in_features} -> {module.out_features}], which this model does not have")
            prefix = f"base_model.model.{module.module}"
            a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
            weights[module.module] = (a.to(layer.weight.device, layer.weight.dtype),
                                      (b * info.scaling).to(layer.weight.device, layer.weight.dtype))
        return weights

    # ------------------------------------------------------------------ requests

    def served_checksums(self, algorithm: str) -> dict:
        """``--check-weight-update-equal`` under adapter versions: the served adapter's tensors as it
        loaded them, by PEFT name (what the trainer published for that version)."""
        with self._lock:
            adapter = self._adapters.get(self.served) if self.served else None
        if adapter is None:
            raise InvalidInput("no LoRA adapter version is served yet")
        return {"weight_version": adapter.version, "algorithm": algorithm, "source": "lora",
                "checksums": adapter.sums(algorithm)}

    def serve(self, name: str) -> str | None:
        """Make ``name`` the adapter of requests that name none; returns the one it replaces."""
        with self._lock:
            if name not in self._adapters or self._adapters[name].unloading:
                raise InvalidInput(f"no LoRA adapter named {name!r} is loaded")
            previous, self.served = self.served, name
            return previous

    def acquire(self, name: str | None) -> ResidentAdapter | None:
        """The adapter a new request runs with, held until :meth:`release` (``InvalidInput``: not served);
        ``name`` None: the served adapter (:meth:`serve`), or the base when none is."""
        with self._lock:
            if name is None:
                if self.served is None:
                    return None
                name = self.served
            adapter = self._adapters.get(name)
            if adapter is None or adapter.unloading:
                raise InvalidInput(f"lora_path {name!r} names no loaded LoRA adapter "
                                   f"(loaded: {sorted(n for n, a in self._adapters.items() if not a.unloading)})")
            adapter.in_flight += 1
            return adapter

    def release(self, adapter: ResidentAdapter) -> None:
        with self._lock:
            adapter.in_flight -= 1
            if adapter.unloading and adapter.in_flight == 0 and self._adapters.get(adapter.name) is adapter:
                del self._adapters[adapter.name]

    def describe(self) -> list[dict]:
        with self._lock:
            return [a.describe() for a in self._adapters.values()]

    def load_request(self, req: LoadLoraAdapter) -> dict:
        """``/load_lora_adapter``'s answer (SGLang's ``LoadLoRAAdapterReqOutput`` fields)."""
        adapter = self.load(req.lora_name, req.lora_path, req.pinned)
        return {"success": True, "error_message": "", "adapter": adapter, "loaded_adapters": self.live_names()}

    def unload_request(self, req: UnloadLoraAdapter) -> dict:
        outcome = self.unload(req.lora_name)
        return {"success": True, "error_message": "", **outcome, "loaded_adapters": self.live_names()}

    def live_names(self) -> dict[str, str]:
        """The adapters that take new requests (not unloading): name -> path."""
        with self._lock:
            return {a.name: a.path for a in self._adapters.values() if not a.unloading}

    @contextlib.contextmanager
    def rows(self, adapters: list[ResidentAdapter | None]) -> Iterator[None]:
        """The forward passes inside run row ``i`` with ``adapters[i]`` (None: the base)."""
        self._rows = _batch_rows(adapters)
        try:
            yield
        finally:
            self._rows = _Rows()

    def _hook(self, module_name: str):
        def apply(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            rows = self._rows
            if not rows.adapters:
                return output
            a, b = self._stacked(module_name, rows.adapters, module.weight)
            hidden = inputs[0] @ a  # [rows, tokens, total rank]
            if rows.mask is not None:  # several adapters (or the base too): each row keeps its own block
                hidden = hidden * rows.mask.to(hidden.device, hidden.dtype)
            return output.add_(hidden @ b)  # the projection's own fresh output (inference only)
        return apply

    def _stacked(self, module_name: str, adapters: tuple[ResidentAdapter, ...], weight: torch.Tensor):
        """``(A^T, alpha / r * B^T)`` of ``adapters`` side by side along the rank (zeros where one does
        not adapt this module): one pair of matmuls for a batch whatever its mix of adapters."""
        key = (module_name, tuple(a.key for a in adapters))
        stacked = self._stacks.get(key)
        if stacked is None:
            parts = [a.weights.get(module_name) for a in adapters]
            a_t = torch.cat([p[0].T if p else weight.new_zeros(weight.shape[1], ad.info.rank)
                             for p, ad in zip(parts, adapters)], dim=1).contiguous()
            b_t = torch.cat([p[1].T if p else weight.new_zeros(ad.info.rank, weight.shape[0])
                             for p, ad in zip(parts, adapters)], dim=0).contiguous()
            if len(self._stacks) > MAX_STACKS:
                self._stacks.clear()
            stacked = self._stacks[key] = (a_t, b_t)
        return stacked


class AdapterVersions:
    """``--lora-base-dir``: the engine serves a run's LoRA adapter versions beside its resident base.

    ``/pull_weights`` materializes the store's adapter chain (version 0 at ``--lora-base-dir``) into
    the local checkpoint and verifies it, as it would a model version; ``/activate_weights`` then
    loads that version beside the ones served, makes it the served adapter and the engine's version,
    and keeps the ``keep`` (``--lora-resident-versions``) newest activated versions resident: a request
    naming an older one's adapter (``lora_path`` of :meth:`resident`) runs on it, and the oldest beyond
    ``keep`` is unloaded, leaving once its in-flight requests end: nothing pauses or waits. A request
    that names no ``lora_path`` runs on the served adapter (never the bare base), and each request
    reports the version of the adapter it ran on, start to end. ``from_store``
    (``--lora-base-from-store``): version 0 is the object store's, fetched onto this node at
    ``base_dir`` by the first pull (checked whole; a refused one leaves nothing loaded)."""

    def __init__(self, bank: LoraBank, base_dir: Path, keep: int = 2, from_store: bool = False):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.bank, self.base_dir, self.keep, self.from_store = bank, Path(base_dir), keep, from_store
        self.prepared: dict[int, Path] = {}
        self.activated: list[int] = []  # the resident activated versions, oldest first (the last one served)
        self._lock = threading.Lock()

    def pull(self, source: str, version: int, local: Path, pre_read_hook=None) -> dict:
        from miles_disagg.weights.materializer import Materializer

        started = time.perf_counter()
        if self.from_store:
            from miles_disagg.weights.object_base import fetch_adapter_base

            fetch_adapter_base(str(source), self.base_dir)  # kept while the store names the same one
        host = Materializer(local, base_dir=self.base_dir, pre_read_hook=pre_read_hook)
        try:
            prepared = host.prepare(source, version)
        finally:
            host.close()
        self._stage(prepared.ref.version, Path(prepared.path))
        return {"success": True, "message": f"Prepared LoRA adapter version {version}; activate it with "
                                            "/activate_weights (no pause)", "target_version": prepared.ref.version,
                "run_id": prepared.ref.run_id, "path": str(prepared.path), "lora": True,
                "prepare_ms": round((time.perf_counter() - started) * 1e3, 3), "transfer": prepared.transfer}

    def _stage(self, version: int, path: Path) -> None:
        """Read the prepared version's tensors now (its slot is rewritten by the pull after next)."""
        name = adapter_name(version)
        if name not in {a["lora_name"] for a in self.bank.describe()}:
            self.bank.load_dir(name, path, version=str(version))
        with self._lock:
            self.prepared[version] = path

    def activate(self, version: int, set_version) -> dict:
        """Serve adapter ``version`` (prepared by :meth:`pull`): no pause; the previous adapter leaves
        once its requests end. ``set_version``: makes the engine report ``version``."""
        name = adapter_name(version)
        with self._lock:
            if version not in self.prepared:
                raise InvalidInput(f"LoRA adapter version {version} was not prepared by /pull_weights")
        self.bank.serve(name)
        set_version(str(version))
        with self._lock:
            self.activated = [v for v in self.activated if v != version] + [version]
            evicted, self.activated = self.activated[:-self.keep], self.activated[-self.keep:]
            for old in evicted:
                self.prepared.pop(old, None)
        for old in evicted:
            with contextlib.suppress(InvalidInput):  # InvalidInput: it was unloaded by hand already
                self.bank.unload(adapter_name(old))  # leaves once its requests end; never waits
        return {"success": True, "weight_version": str(version), "pause_ms": 0.0, "activation": "lora",
                "resident_weight_versions": self.resident(), "evicted_versions": [str(v) for v in evicted],
                "message": f"Serving LoRA adapter version {version} beside the base (no pause)."}

    def resident(self) -> dict[str, str]:
        """The resident versions, oldest first, each with the ``lora_path`` that runs a request on it
        (the newest is the engine's ``weight_version``, served to requests that name none)."""
        live = self.bank.live_names()
        with self._lock:
            return {str(v): adapter_name(v) for v in self.activated if adapter_name(v) in live}


def resident_versions(bank: LoraBank | None) -> dict:
    """``/model_info``'s and ``/server_info``'s ``resident_weight_versions`` under adapter versions
    (:meth:`AdapterVersions.resident`); nothing otherwise (an engine's one version is its ``weight_version``)."""
    if bank is None or bank.versions is None:
        return {}
    return {"resident_weight_versions": bank.versions.resident()}


def adapter_name(version: int) -> str:
    return f"v{version}"


def _file_checksums(directory: Path):
    """``algorithm -> {name: checksum}`` of an adapter directory's tensors, read once now (its slot
    may be rewritten later) and hashed when asked."""
    from miles_disagg.weights.checksums import checksum
    from miles_disagg.weights.safetensors_io import checkpoint_tensors, read_bytes

    raw = {name: bytes(read_bytes(directory / file, entry)) for name, (file, entry) in checkpoint_tensors(directory).items()}
    return lambda algorithm: {name: checksum(algorithm, data) for name, data in raw.items()}
