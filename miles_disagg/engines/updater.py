"""Weight updaters: bring a set of engines to the trainer's newest version.

``DiskDeltaUpdater.update(version)`` runs the reference order after the publisher has
committed ``version``, with the per-engine steps of :mod:`miles_disagg.engines.activation`:

1. :func:`~miles_disagg.engines.activation.prepare` on every engine at once, before any
   pause: each host materializes and verifies the version while it keeps generating. One
   failure fails the update here, and no engine has been paused.
2. Per engine, in parallel: the router stops sending it requests, then
   :func:`~miles_disagg.engines.activation.activate` (pause, flush, load, continue, verify),
   and the router routes to it again by the version it really serves. An engine whose pull
   answer announced it (the built-in engine, ``miles-disagg agent``) does all of that itself in
   one request (``/activate_weights``), so its pause holds no round trip to this process and does
   not grow with the number of engines updated at once; a stock SGLang gets the five requests, at
   most :data:`MAX_STEPPING_AT_ONCE` engines at a time (a rolling activation, so one engine's pause
   does not wait on the others' requests either).

Both phases run on one event loop (a private thread's, so a caller inside a loop is fine) with
:class:`~miles_disagg.engines.async_client.AsyncEngineClient`: with a thread and a synchronous
client per engine the fan-out to 256 engines took 7.8x its time for 8 (``bench scale``).

``BroadcastUpdater`` is SGLang's stock torch.distributed path: the same activation, with
the load step receiving the tensors over the weight-update group while the trainer broadcasts.
Either raises :class:`UpdateFailed` naming each engine and phase that failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from miles_disagg.net.pooled_http import run_loop
from miles_disagg.engines.activation import activate, activate_async, prepare, prepare_async
from miles_disagg.engines.client import EngineClient
from miles_disagg.types import MilesDisaggError, ReplaceReplica


DEFAULT_BUCKET_BYTES = 512 * 1024**2
CONNECT_TIMEOUT_S = 30.0
MAX_STEPPING_AT_ONCE = 8
"""Engines on the per-step activation path (no one-call) paused at once in one update: each such pause holds
four round trips to this process, so with every engine paused together each pause waited for every other
engine's requests and grew with their number (4.0x at 256 engines against 8, ``bench scale``: ``fanout_per_step``); a rolling
activation of this many at a time keeps one engine's pause what it is for a few engines."""


class UpdateFailed(ReplaceReplica):
    """An engine failed an update; the message names it and the phase."""


class RouterHookFailed(MilesDisaggError):
    """Telling the router that an engine pauses or serves again failed (the engine itself may be fine)."""


class RouterCallsFailed(UpdateFailed):
    """Every failure of the update was a router call's (:class:`RouterHookFailed`): the engines that did
    not activate still serve the version before, and the update may be made again once the router answers."""


@dataclass
class UpdateReport:
    version: int
    prepare_time_s: float  # slowest engine's /pull_weights, overlapping generation
    pause_time_s: float  # longest time any engine could not generate (one call: as the engine measured it)
    activate_time_s: float  # whole step 2 (all engines, in parallel)
    per_engine_pause_s: list[float] = field(default_factory=list)
    wan_bytes_by_region: dict[str, int] = field(default_factory=dict)  # object stores: what crossed the WAN
    relay_fallbacks: int = 0  # pulls that went to the store because the region's relay failed

    def metrics(self) -> dict[str, float]:
        metrics = {"perf/update_weights_prepare_time": self.prepare_time_s,
                   "perf/update_weights_pause_time": self.pause_time_s,
                   "perf/update_weights_activate_time": self.activate_time_s}
        for region, wan in sorted(self.wan_bytes_by_region.items()):
            metrics[f"weights/wan_bytes/{region or 'default'}"] = float(wan)
        if self.wan_bytes_by_region:
            metrics["weights/relay_fallbacks"] = float(self.relay_fallbacks)
        return metrics


def wan_by_region(pull_answers: Sequence[dict]) -> tuple[dict[str, int], int]:
    """Bytes that crossed the WAN per region for one version (each engine's direct pulls plus what its
    region's relay pulled for it), and the relay fallbacks, from the engines' pull answers (engines
    reading a directory store report none)."""
    wan: dict[str, int] = {}
    fallbacks = 0
    for answer in pull_answers:
        transfer = answer.get("transfer") if isinstance(answer, dict) else None
        if not isinstance(transfer, dict) or not transfer:
            continue
        region = str(answer.get("region") or "")
        wan[region] = wan.get(region, 0) + int(transfer.get("wan_bytes", 0))
        fallbacks += int(transfer.get("relay_fallbacks", 0))
    return wan, fallbacks


StateHook = Callable[[str, str], None]  # (engine url, "paused" | "ready")


class _Fleet:
    """Engines updated together: their clients, the router hook, and one thread per engine."""

    def __init__(self, clients: list[EngineClient], pause_mode: str, set_state: StateHook | None, name: str):
        self.clients, self.pause_mode = clients, pause_mode
        self.set_state = set_state or (lambda url, state: None)
        self.has_router_hook = set_state is not None
        self._pool = ThreadPoolExecutor(max(1, len(clients)), thread_name_prefix=name)

    def _all(self, fn: Callable[[int], object], phase: str) -> list:
        futures = [self._pool.submit(fn, i) for i in range(len(self.clients))]
        results, errors = [], []
        for client, future in zip(self.clients, futures):
            try:
                results.append(future.result())
            except MilesDisaggError as exc:
                errors.append(f"{phase} on {client.url}: {exc}")
        if errors:
            raise UpdateFailed("; ".join(errors))
        return results

    def _activate(self, index: int, version: int, **kwargs) -> float:
        """The router stops routing to the engine, it activates, the router routes to it again."""
        client = self.clients[index]
        self.set_state(client.url, "paused")
        try:
            return activate(client, version, pause_mode=self.pause_mode, **kwargs)
        finally:
            self.set_state(client.url, "ready")  # routed again by the version it really serves

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for c in self.clients:
            c.close()


class DiskDeltaUpdater(_Fleet):
    def __init__(self, engine_urls: Sequence[str], *, store_dir: str, local_dirs: Sequence[str],
                 pause_mode: str = "retract", set_state: StateHook | None = None):
        if len(local_dirs) != len(engine_urls):
            raise ValueError("one local checkpoint dir per engine")
        clients = [EngineClient(url, store_dir=store_dir, local_checkpoint_dir=local)
                   for url, local in zip(engine_urls, local_dirs)]
        super().__init__(clients, pause_mode, set_state, "update")

    def update(self, version: int) -> UpdateReport:
        """Prepare everywhere, then activate everywhere (see the module docstring)."""
        return run_in_own_loop(self._update_async(version))

    async def _update_async(self, version: int) -> UpdateReport:
        from miles_disagg.engines.async_client import AsyncEngineClient
        from miles_disagg.net.pooled_http import PooledSession

        session = PooledSession(max_connections=None, connect_timeout_s=CONNECT_TIMEOUT_S, read_timeout_s=None)
        try:
            engines = [AsyncEngineClient(c.url, session, store_dir=c.store_dir, local_checkpoint_dir=c.local_dir,
                                         keys=c.keys) for c in self.clients]
            start = time.perf_counter()
            await self._all_async([self.prepare_one(i, engine, version) for i, engine in enumerate(engines)],
                                  "prepare")
            prepared = time.perf_counter()
            stepping = asyncio.Semaphore(MAX_STEPPING_AT_ONCE)  # the per-step path's engines paused at once
            pauses = await self._all_async([self._activate_async(engine, version, stepping) for engine in engines],
                                           "activate")
            done = time.perf_counter()
        finally:
            await session.aclose()
        wan, fallbacks = wan_by_region([engine.last_pull for engine in engines])
        return UpdateReport(version, prepared - start, max(pauses, default=0.0), done - prepared, pauses, wan, fallbacks)

    async def prepare_one(self, index: int, engine: Any, version: int) -> None:
        """Step 1 for engine ``index`` inside :meth:`update` (``engine``: its asynchronous client)."""
        await prepare_async(engine, version)

    async def _all_async(self, steps: list[Awaitable[Any]], phase: str) -> list:
        """Every step at once; :class:`UpdateFailed` naming each engine whose step failed (as ``_all``)."""
        outcomes = await asyncio.gather(*steps, return_exceptions=True)
        errors = [f"{phase} on {client.url}: {outcome}" for client, outcome in zip(self.clients, outcomes)
                  if isinstance(outcome, MilesDisaggError)]
        unexpected = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, MilesDisaggError)]
        if unexpected:
            raise unexpected[0]
        failed = [o for o in outcomes if isinstance(o, MilesDisaggError)]
        if failed and all(isinstance(o, RouterHookFailed) for o in failed):
            raise RouterCallsFailed("; ".join(errors))
        if errors:
            raise UpdateFailed("; ".join(errors))
        return outcomes

    async def _activate_async(self, engine: Any, version: int, stepping: asyncio.Semaphore) -> float:
        """``_activate`` on the loop (an engine on the per-step path holds one of ``stepping``'s places
        from its router pause to its router ready); the router hook (synchronous) runs on the fleet's
        threads. An activation's own failure wins over a failure to tell the router afterwards."""
        if getattr(engine, "one_call_activation", False) is True:
            return await self._activate_sequence(engine, version)
        async with stepping:
            return await self._activate_sequence(engine, version)

    async def _activate_sequence(self, engine: Any, version: int) -> float:
        await self._tell_router(engine.url, "paused")
        try:
            pause_s = await activate_async(engine, version, pause_mode=self.pause_mode)
        except BaseException:
            with contextlib.suppress(RouterHookFailed):
                await self._tell_router(engine.url, "ready")  # routed again by the version it really serves
            raise
        await self._tell_router(engine.url, "ready")
        return pause_s

    async def _tell_router(self, url: str, state: str) -> None:
        """The router hook (synchronous) on the fleet's threads; its failure is :class:`RouterHookFailed`."""
        if self.has_router_hook:
            try:
                await asyncio.get_running_loop().run_in_executor(self._pool, self.set_state, url, state)
            except MilesDisaggError as exc:
                raise RouterHookFailed(f"telling the router {url} is {state}: {type(exc).__name__}: {exc}") from exc

    def prepare(self, index: int, version: int) -> None:
        prepare(self.clients[index], version)

    def activate(self, index: int, version: int) -> float:
        """Pause, load the prepared version, continue, verify; returns the pause length (seconds)."""
        return self._activate(index, version)


class BroadcastUpdater(_Fleet):
    """``--update-weight-transfer-mode broadcast``: SGLang's stock torch.distributed path.

    ``init_group`` has every engine join the trainer's weight-update group with
    ``/init_weights_update_group``; the trainer joins concurrently as rank 0. An SGLang engine
    joins with one rank per tensor-parallel worker (``rank_offset + tp_rank``), so engine i
    starts at ``1 + sum of the ranks of engines before it`` and the world is ``1 + sum of every
    engine's ranks`` (``ranks_per_engine``: each engine's TP size; default one each).
    ``update`` activates every engine at once, each loading by
    ``/update_weights_from_distributed`` (they receive while the trainer broadcasts).
    """

    def __init__(self, engine_urls: Sequence[str], *, pause_mode: str = "retract", set_state: StateHook | None = None,
                 group_name: str = "miles_disagg_weight_update", ranks_per_engine: Sequence[int] | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        ranks = [1] * len(engine_urls) if ranks_per_engine is None else list(ranks_per_engine)
        if len(ranks) != len(engine_urls) or any(not isinstance(r, int) or r < 1 for r in ranks):
            raise ValueError(f"ranks_per_engine must give a positive int per engine, got {ranks_per_engine!r}")
        super().__init__([EngineClient(url) for url in engine_urls], pause_mode, set_state, "broadcast")
        self.group_name = group_name
        self.ranks_per_engine = ranks
        self.rank_offsets = rank_offsets(ranks)
        self.bucket_bytes = bucket_bytes

    @property
    def world_size(self) -> int:
        return 1 + sum(self.ranks_per_engine)

    def init_group(self, master_addr: str, master_port: int) -> None:
        def join(i: int) -> None:
            self.clients[i].init_weights_update_group({
                "master_address": master_addr, "master_port": master_port, "rank_offset": self.rank_offsets[i],
                "world_size": self.world_size, "group_name": self.group_name, "backend": "nccl"})
        self._all(join, "init_weights_update_group")

    def update(self, version: int, meta: dict[str, list]) -> UpdateReport:
        """Every engine receives ``meta``'s tensors in buckets of at most ``bucket_bytes``
        (miles' ``--update-weight-buffer-size``), one ``/update_weights_from_distributed`` per
        bucket, all inside one pause; the last bucket sets ``weight_version`` (and flushes)."""
        start = time.perf_counter()
        buckets = plan_buckets(meta, self.bucket_bytes)
        bodies = [{**bucket, "group_name": self.group_name, "flush_cache": False} for bucket in buckets]
        bodies[-1].update(weight_version=str(version), flush_cache=self.pause_mode != "in_place")

        def one(i: int) -> float:
            client = self.clients[i]

            def receive() -> None:
                def load() -> None:
                    for body in bodies:
                        client.update_weights_from_distributed(body)
                in_weight_update_session(client, load)
            return self._activate(i, version, flush=False, load=receive)

        pauses = self._all(one, "update")
        return UpdateReport(version, 0.0, max(pauses, default=0.0), time.perf_counter() - start, pauses)


def run_in_own_loop(coroutine: Awaitable[Any]) -> Any:
    """Run ``coroutine`` to completion on a new event loop in a thread of its own (the caller may
    itself be on a loop, e.g. an async Ray actor's) and return its result or raise its error."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = run_loop(coroutine)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="update-fanout", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def plan_buckets(meta: dict[str, list], bucket_bytes: int) -> list[dict[str, list]]:
    """Consecutive runs of ``meta``'s tensors (names, dtypes, shapes in broadcast order) of at
    most ``bucket_bytes`` each; a tensor larger than that is a bucket of its own."""
    import math

    buckets: list[dict[str, list]] = []
    current: dict[str, list] = {"names": [], "dtypes": [], "shapes": []}
    size = 0
    for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"]):
        nbytes = math.prod(shape) * DTYPE_BYTES[str(dtype).removeprefix("torch.")]
        if current["names"] and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = {"names": [], "dtypes": [], "shapes": []}, 0
        for key, value in (("names", name), ("dtypes", dtype), ("shapes", shape)):
            current[key].append(value)
        size += nbytes
    if current["names"] or not buckets:
        buckets.append(current)
    return buckets


def in_weight_update_session(client: EngineClient, load: Callable[[], None]) -> None:
    """``load`` between ``/begin_weight_update`` and ``/end_weight_update`` (SGLang >= 0.5.21 refuses
    distributed and tensor updates outside such a session; the built-in engine acknowledges both).
    The session is closed whatever ``load`` did; ``load``'s error wins over the close's."""
    client.begin_weight_update()
    try:
        load()
    except BaseException:
        try:
            client.end_weight_update()
        except Exception:  # noqa: BLE001 - the load's error is the one to report
            pass
        raise
    client.end_weight_update()


def rank_offsets(ranks_per_engine: Sequence[int]) -> list[int]:
    """Each engine's first rank in the weight-update group (rank 0 is the trainer): cumulative."""
    offsets, next_rank = [], 1
    for ranks in ranks_per_engine:
        offsets.append(next_rank)
        next_rank += ranks
    return offsets


def engine_ranks(server_info: dict) -> int:
    """How many ranks an engine joins a weight-update group with: its tensor-parallel size
    (SGLang joins each TP worker at ``rank_offset + tp_rank``; the built-in engine reports 1)."""
    tp_size = server_info.get("tp_size", 1)
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"the engine reports tp_size {tp_size!r}")
    return tp_size
