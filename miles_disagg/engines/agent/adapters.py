"""A run's LoRA adapter versions served by stock SGLang through the agent (``--lora-base-dir``).

The agent materializes each adapter version of the store into its local checkpoint as it would a
model version (the chain's version 0 is ``--lora-base-dir``, or with ``--lora-base-from-store`` the
object store's, fetched onto this node by the first pull), and ``/activate_weights`` then
serves it without a pause: the version's files are copied to a directory of their own (the slot
is rewritten by the pull after next), loaded into SGLang beside the versions it serves
(``/load_lora_adapter`` ``{lora_name: "vN", lora_path}``), and SGLang's label is moved with
``/update_weight_version`` (``abort_all_requests`` false: nothing in flight is touched). The
newest ``keep`` versions stay resident; the activation that makes one more unloads the oldest in
the background (SGLang's unload waits for that adapter's requests to end; the activation never
waits for it, the #2780 deadlock).

Every ``/generate`` the agent forwards runs on an adapter: a body that names no ``lora_path`` gets
the served version's (stock SGLang would run it on the bare base), and the answer's
``meta_info`` (each event of a streamed one) names the adapter version each item ran on, start to end (SGLang's own label is the
engine's at the end, which may be a newer version's). ``/model_info`` gains
``resident_weight_versions`` (``{"N": "vN"}``), which the router reads for ``exact_version``
requests of an older resident version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any, AsyncGenerator, AsyncIterator

from miles_disagg.types import InvalidInput

log = logging.getLogger(__name__)

DEFAULT_KEEP = 2
LOAD_PATH, UNLOAD_PATH, LABEL_PATH = "/load_lora_adapter", "/unload_lora_adapter", "/update_weight_version"


def adapter_name(version: int) -> str:
    return f"v{version}"


def version_of(name: Any) -> int | None:
    """The adapter version a ``lora_path`` of ours names (``"v7"`` -> 7); None for any other name."""
    if isinstance(name, str) and name[:1] == "v" and name[1:].isascii() and name[1:].isdigit():
        return int(name[1:])
    return None


class AgentAdapters:
    """The adapter versions resident on the agent's SGLang engine (see the module docstring)."""

    def __init__(self, base_dir: Path, local_dir: Path, keep: int = DEFAULT_KEEP, from_store: bool = False):
        if keep < 1:
            raise InvalidInput(f"--lora-resident-versions must be >= 1, got {keep}")
        self.base_dir, self.keep, self.from_store = Path(base_dir), keep, from_store
        self.root = local_dir.parent / f"{local_dir.name}.adapters"
        self.resident: list[int] = []  # ascending activation order; the last is served
        self.loaded: set[int] = set()  # loaded into the engine (resident, or activated halfway, or leaving)
        self._lock = threading.Lock()
        self._unloads: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ state

    def served(self) -> int | None:
        with self._lock:
            return self.resident[-1] if self.resident else None

    def resident_map(self) -> dict[str, str]:
        with self._lock:
            return {str(v): adapter_name(v) for v in self.resident}

    def info(self) -> dict:
        return {"lora_base_dir": str(self.base_dir), "lora_base_from_store": self.from_store,
                "lora_resident_versions": self.keep, "resident_weight_versions": self.resident_map(),
                "served_lora_version": self.served()}

    def fetch_base(self, source: str | Path) -> None:
        """``--lora-base-from-store``: the store's adapter chain's version 0 at ``base_dir`` on this
        node (fetched the first time, checked whole; the pull's typed errors otherwise)."""
        if self.from_store:
            from miles_disagg.weights.object_base import fetch_adapter_base

            fetch_adapter_base(str(source), self.base_dir)

    # ------------------------------------------------------------------ activation

    def stage(self, version: int, slot: Path) -> Path:
        """The held slot's adapter copied to a directory of its own (checked whole); returns it."""
        from miles_disagg.weights.adapters import check_adapter_dir

        check_adapter_dir(slot)
        target = self.root / adapter_name(version)
        if target.exists():
            shutil.rmtree(target)
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".{adapter_name(version)}.staging"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(slot, staging, symlinks=False)
        staging.rename(target)
        return target

    async def activate(self, engine, version: int, directory: Path) -> dict:
        """Load ``directory`` as adapter ``version`` beside the resident ones and serve it (no pause).
        ``engine``: an :class:`~miles_disagg.engines.async_client.AsyncEngineClient` of SGLang."""
        name = adapter_name(version)
        if version not in self.loaded:  # an activation that failed after its load is made again without it
            engine.checked(await engine.send("POST", LOAD_PATH, {"lora_name": name, "lora_path": str(directory),
                                                                 "pinned": False}), LOAD_PATH)
            self.loaded.add(version)
        engine.checked(await engine.send("POST", LABEL_PATH, {"new_version": str(version),
                                                              "abort_all_requests": False}), LABEL_PATH)
        with self._lock:
            if version in self.resident:
                self.resident.remove(version)
            self.resident.append(version)
            evicted = self.resident[:-self.keep] if len(self.resident) > self.keep else []
            self.resident = self.resident[len(evicted):]
        for old in evicted:  # in the background: SGLang's unload waits for the adapter's requests to end
            task = asyncio.get_running_loop().create_task(self._unload(engine, old))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)
        return {"success": True, "weight_version": str(version), "pause_ms": 0.0, "activation": "lora",
                "lora_path": name, "evicted_versions": [str(v) for v in evicted],
                "message": f"Serving LoRA adapter version {version} beside the base (no pause)."}

    async def _unload(self, engine, version: int) -> None:
        try:
            engine.checked(await engine.send("POST", UNLOAD_PATH, {"lora_name": adapter_name(version)},
                                             timeout_s=None), UNLOAD_PATH)
        except Exception as exc:  # noqa: BLE001 - logged: the adapter stays loaded, nothing is served wrong
            log.warning("unloading LoRA adapter version %s failed: %s", version, exc)
            return
        self.loaded.discard(version)
        shutil.rmtree(self.root / adapter_name(version), ignore_errors=True)

    async def wait_unloads(self) -> None:
        """Until every background unload ended (tests, shutdown)."""
        while self._unloads:
            await asyncio.gather(*list(self._unloads), return_exceptions=True)

    # ------------------------------------------------------------------ requests

    def pin(self, body: Any) -> Any:
        """``body`` (a ``/generate`` JSON object) with the served adapter's ``lora_path`` wherever it
        names none; ``InvalidInput`` when no adapter version is served yet (never the bare base)."""
        if not isinstance(body, dict):
            return body
        paths = body.get("lora_path")
        if isinstance(paths, str):
            return body
        served = self.served()
        if served is None:
            raise InvalidInput("this agent serves a run's LoRA adapter versions and none is activated yet; "
                               "a request would run on the bare base")
        name = adapter_name(served)
        if isinstance(paths, list):
            return {**body, "lora_path": [p if isinstance(p, str) else name for p in paths]}
        return {**body, "lora_path": name}

    @staticmethod
    def label(body: dict, answer: Any) -> Any:
        """``answer`` with each item's ``meta_info`` naming the adapter version it ran on, start to end."""
        paths = body.get("lora_path")
        items = answer if isinstance(answer, list) else [answer]
        for i, item in enumerate(items):
            _label_item(paths[i] if isinstance(paths, list) and i < len(paths) else paths, item)
        return answer

    @staticmethod
    async def label_stream(body: dict, chunks: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
        """A streamed ``/generate``'s SSE bytes with each ``data:`` event labelled as :meth:`label`
        does an answer (a batch's event by its ``index``); ``[DONE]`` and anything that is not a JSON
        object pass unchanged. An event longer than ``MAX_EVENT_BYTES`` ends the stream with an
        error event (never relayed unlabelled)."""
        paths, pending = body.get("lora_path"), b""
        try:
            async for chunk in chunks:
                *events, pending = (pending + chunk).split(b"\n\n")
                for event in events:
                    yield _labelled_event(paths, event) + b"\n\n"
                if len(pending) > MAX_EVENT_BYTES:
                    yield b'data: {"error": {"message": "a streamed event exceeded the agent\'s limit"}}\n\n'
                    return
            if pending:
                yield _labelled_event(paths, pending)
        finally:
            await chunks.aclose()  # the engine's stream closes with ours


MAX_EVENT_BYTES = 16 << 20


def _label_item(path: Any, item: Any) -> None:
    version = version_of(path)
    meta = item.get("meta_info") if isinstance(item, dict) else None
    if version is not None and isinstance(meta, dict):
        meta.update(weight_version=str(version), weight_version_start=str(version), weight_version_end=str(version))


def _labelled_event(paths: Any, event: bytes) -> bytes:
    """One SSE event (``data: {json}``) with its item labelled by the adapter it ran on."""
    if not event.startswith(b"data: ") or b"\n" in event:
        return event
    try:
        item = json.loads(event[len(b"data: "):])
    except ValueError:  # [DONE], or not JSON: nothing to label
        return event
    if not isinstance(item, dict):
        return event
    index = item.get("index", 0)
    if isinstance(paths, list):
        path = paths[index] if isinstance(index, int) and 0 <= index < len(paths) else None
    else:
        path = paths
    _label_item(path, item)
    return b"data: " + json.dumps(item).encode()
