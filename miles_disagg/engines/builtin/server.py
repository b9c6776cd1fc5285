"""FastAPI app: SGLang's HTTP API over an :class:`~miles_disagg.engines.builtin.runtime.Engine`.

Errors are JSON ``{"error": {"message", "type", "retryable"}}`` (plus SGLang's
``success``/``message`` on the weight endpoints) with status 400 for bad input and
refused updates (``InvalidInput``, ``FormatError``, ``LineageError``, ``ChecksumMismatch``,
``LayoutMismatch``), 409 for ``Retryable`` (e.g. ``VersionNotReady``), 503 for
``ReplaceReplica`` (e.g. the scheduler thread died) and 500 only for real internal faults.
A ``/generate`` request ended by an internal fault (``finish_reason`` abort with a 5xx
``status_code``) is answered with that status and ``{"error": {...}}`` (a stream ends with
that error event, then ``[DONE]``), as SGLang does; a plain abort is a 200 with the tokens
so far. ``/health`` is 503 with the reason while the scheduler is dead or its last step
failed. Blocking engine calls (and parsing and tokenizing ``/generate`` bodies) run in
worker threads, so the event loop always answers, and a weight pull never blocks generation.
Every request first passes :mod:`miles_disagg.net.asgi_guard` (API keys, request-size limit). A client that disconnects mid-request has its
request aborted (its slot is freed at the next step boundary).

Aliases of newer SGLang: ``/model_info``, ``/server_info``; ``/generate`` takes PUT too.
This project's own: ``/pull_weights`` (stage a published version while serving),
``/activate_weights`` (activate it in one call: :mod:`miles_disagg.engines.builtin.one_call`),
``/weight_checksums``.
"""

# no "from __future__ import annotations": FastAPI must see the real Request class

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from miles_disagg.net.asgi_guard import ServerGuard, install_guard, server_app
from miles_disagg.engines.activation import ACTIVATE_PATH
from miles_disagg.engines.builtin import control_bodies, one_call, protocol
from miles_disagg.engines.builtin.control_bodies import LoadLoraAdapter, UnloadLoraAdapter
from miles_disagg.engines.builtin.runtime import Engine
from miles_disagg.engines.builtin.sequence import Sequence
from miles_disagg.net.httpjson import error_json, parse_json, status_for
from miles_disagg.types import InvalidInput

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
INLINE_BODY_BYTES = 16 * 1024  # /generate bodies up to this are parsed and tokenized on the event loop
HEALTH_GENERATE_TIMEOUT_S = 20.0


def error_response(exc: BaseException, *, weight_endpoint: bool = False):
    """The JSON error answer for ``exc`` (status by :func:`~miles_disagg.net.httpjson.status_for`); a weight
    endpoint's also carries SGLang's ``success: false`` and ``message``."""
    status = status_for(exc)
    body: dict[str, Any] = error_json(exc, status)
    if weight_endpoint:
        body = {"success": False, "message": body["error"]["message"], **body}
    return JSONResponse(body, status_code=status)


class _HttpSink:
    """Bridges one sequence from the scheduler thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: Engine, stream: bool):
        self.loop, self.engine, self.stream = loop, engine, stream
        self.done: asyncio.Future = loop.create_future()
        self.chunks: asyncio.Queue | None = asyncio.Queue() if stream else None

    def on_token(self, seq: Sequence) -> None:
        if self.chunks is not None:
            chunk = self.engine.result_json(seq)
            self.loop.call_soon_threadsafe(self.chunks.put_nowait, chunk)

    def on_finish(self, seq: Sequence) -> None:
        result = self.engine.result_json(seq)
        self.loop.call_soon_threadsafe(self._resolve, result)

    def _resolve(self, result: dict) -> None:
        if not self.done.done():
            self.done.set_result(result)
        if self.chunks is not None:
            self.chunks.put_nowait(None)


class EngineEndpoints:
    """SGLang's endpoints over one :class:`Engine`, one method per route (the module docstring states
    the contracts). Blocking engine calls run on ``executor``, this server's own pool: long blocking
    calls (a pull, a group rendezvous) must not starve short ones."""

    def __init__(self, engine: Engine, executor: ThreadPoolExecutor):
        self.engine, self.executor = engine, executor

    async def blocking(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def inline(self, fn: Callable, *args) -> Any:
        return fn(*args)

    # ------------------------------------------------------------------ generation

    async def generate(self, request: Request):
        engine = self.engine
        try:
            body = await request.body()
            # a small body is parsed and tokenized here: two trips through the pool cost more CPU
            # than the work (most rollout requests); a large one must not hold up the loop
            run = self.inline if len(body) <= INLINE_BODY_BYTES else self.blocking
            req = await run(protocol.parse_generate, body, engine.runner.max_context, engine.max_request_tokens)
            loop = asyncio.get_running_loop()
            sinks = [_HttpSink(loop, engine, req.stream) for _ in req.items]  # made on the loop
            handed = iter(sinks)
            seqs = await run(engine.make_sequences, req, lambda _item: next(handed))  # tokenizes
        except Exception as exc:
            return error_response(exc)
        for seq in seqs:
            engine.submit(seq)
        if req.stream:
            return StreamingResponse(self._stream(seqs[0], sinks[0]), media_type="text/event-stream")
        results = await self._wait_or_abort(request, seqs, sinks)
        if results is None:
            return Response(status_code=499)
        fault = next((f for f in map(_fault_of, results) if f is not None), None)
        if fault is not None:  # an internal fault failed the request: 5xx, as SGLang does
            return JSONResponse({"error": fault}, status_code=fault["code"])
        return JSONResponse(results if req.batched else results[0])

    async def _wait_or_abort(self, request: Request, seqs: list[Sequence], sinks: list[_HttpSink]):
        """Every result, or None once the client disconnected (its sequences are then aborted)."""
        everything = asyncio.gather(*(s.done for s in sinks))
        while True:
            done, _ = await asyncio.wait({everything}, timeout=DISCONNECT_POLL_S)
            if done:
                return everything.result()
            if await request.is_disconnected():
                for seq in seqs:
                    self.engine.abort_async(seq.rid)
                return None

    async def _stream(self, seq: Sequence, sink: _HttpSink):
        """SSE events of one sequence, then ``[DONE]``; a stream dropped before the end aborts it."""
        finished = False
        try:
            while True:
                chunk = await sink.chunks.get()
                if chunk is None:
                    finished = True
                    final = sink.done.result()
                    fault = _fault_of(final)
                    yield f"data: {json.dumps({'error': fault} if fault else final)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                yield f"data: {json.dumps(chunk)}\n\n"
        finally:
            if not finished:
                self.engine.abort_async(seq.rid)

    # ------------------------------------------------------------------ weights

    async def weight_call(self, request: Request, handler: Callable[[bytes], Awaitable[dict]]):
        """A weight endpoint's answer: ``handler``'s dict for the request body, or its error (SGLang's shape)."""
        try:
            return JSONResponse(await handler(await request.body()))
        except Exception as exc:
            return error_response(exc, weight_endpoint=True)

    async def parse_then_call(self, request: Request, parse: Callable[[bytes], Any], call: Callable[[Any], dict]):
        """Validate the body as ``parse``'s SGLang request type, then run the blocking ``call`` with it."""
        async def handler(body: bytes) -> dict:
            return await self.blocking(call, parse(body))
        return await self.weight_call(request, handler)

    async def update_weights_from_disk(self, request: Request):
        return await self.parse_then_call(request, control_bodies.UpdateFromDisk.from_json,
                                          self.engine.updates.update_from_disk)

    async def activate_weights(self, request: Request):
        """This project's one-call activation (:mod:`miles_disagg.engines.builtin.one_call`): 503 with
        ``success: false`` naming each fault once the pause began; 400/403 before anything paused."""
        return await self.parse_then_call(request, one_call.ActivateWeights.from_json,
                                          lambda req: one_call.activate_here(self.engine, req))

    async def load_lora_adapter(self, request: Request):
        return await self.parse_then_call(request, LoadLoraAdapter.from_json,
                                          lambda req: self._lora_bank().load_request(req))

    async def unload_lora_adapter(self, request: Request):
        return await self.parse_then_call(request, UnloadLoraAdapter.from_json,
                                          lambda req: self._lora_bank().unload_request(req))

    def _lora_bank(self):
        if self.engine.lora is None:
            raise InvalidInput("LoRA adapters need an engine started with --enable-lora")
        return self.engine.lora

    async def pull_weights(self, request: Request):
        return await self.parse_then_call(request, control_bodies.PullWeights.from_json,
                                          self.engine.updates.pull_weights)

    async def init_weights_update_group(self, request: Request):
        return await self.parse_then_call(request, control_bodies.InitGroup.from_json,
                                          self.engine.updates.init_weights_update_group)

    async def update_weights_from_distributed(self, request: Request):
        return await self.parse_then_call(request, control_bodies.DistributedUpdate.from_json,
                                          self.engine.updates.update_from_distributed)

    async def update_weights_from_tensor(self, request: Request):
        return await self.parse_then_call(request, control_bodies.UpdateFromTensor.from_json,
                                          self.engine.updates.update_from_tensor)

    async def destroy_weights_update_group(self, request: Request):
        async def handler(body: bytes) -> dict:
            req = control_bodies.DestroyGroup.from_json(body)
            return await self.blocking(self.engine.updates.destroy_weights_update_group, req.group_name)
        return await self.weight_call(request, handler)

    async def update_weight_version(self, request: Request):
        async def handler(body: bytes) -> dict:
            req = control_bodies.UpdateWeightVersion.from_json(body)
            await self.blocking(self.engine.updates.set_version, req.new_version, req.abort_all_requests)
            return {"success": True, "message": f"Weight version updated to {req.new_version}",
                    "new_version": req.new_version}
        return await self.weight_call(request, handler)

    # miles brackets broadcast updates with these two (a packed/quantized engine restores and re-packs
    # its weights); this engine loads unpacked tensors, so both only acknowledge.
    async def begin_weight_update(self, request: Request):
        return await self.weight_call(request, _acknowledge("/begin_weight_update"))

    async def end_weight_update(self, request: Request):
        return await self.weight_call(request, _acknowledge("/end_weight_update"))

    async def get_weight_version(self):
        return {"weight_version": self.engine.version}

    async def weight_checksums(self, algorithm: str = "xxh3-128"):
        try:
            return JSONResponse(await self.blocking(self.engine.weight_checksums, algorithm))
        except Exception as exc:
            return error_response(exc)

    # ------------------------------------------------------------------ colocation (GET or POST, the tags optional)

    async def release_memory_occupation(self, request: Request):
        return await self.weight_call(request, self._memory_call(self.engine.release_memory))

    async def resume_memory_occupation(self, request: Request):
        return await self.weight_call(request, self._memory_call(self.engine.resume_memory))

    def _memory_call(self, call: Callable[[Any], dict]):
        async def handler(body: bytes) -> dict:
            tags = control_bodies.MemoryOccupation.from_json(body or b"{}").tags
            return await self.blocking(call, list(tags) if tags is not None else None)
        return handler

    # ------------------------------------------------------------------ pause / cache / abort

    async def pause_generation(self, request: Request):
        try:
            mode = control_bodies.PauseGeneration.from_json(await request.body()).mode
            count = await self.blocking(self.engine.pause, mode)
        except Exception as exc:
            return error_response(exc)
        return {"message": "Generation paused successfully.", "status": "ok", "mode": mode,
                "num_paused_requests": count}

    async def continue_generation(self, request: Request):
        try:
            parse_json(await request.body())  # a JSON object (SGLang's takes no fields)
            await self.blocking(self.engine.resume)
        except Exception as exc:
            return error_response(exc)
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def flush_cache(self):
        """SGLang: 200 when idle (the prefix cache is emptied), 400 while requests run."""
        try:
            ok = await self.blocking(self.engine.flush_cache)
        except Exception as exc:
            return error_response(exc)
        if ok:
            return PlainTextResponse("Cache flushed.\n", status_code=200)
        return PlainTextResponse("Cache not flushed: requests are running or hold KV in place. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n",
                                 status_code=400)

    async def abort_request(self, request: Request):
        try:
            req = control_bodies.AbortReq.from_json(await request.body())
            await self.blocking(self.engine.abort, req.rid, req.abort_all)
        except Exception as exc:
            return error_response(exc)
        return Response(status_code=200)

    # ------------------------------------------------------------------ health

    async def health(self):
        problem = self.engine.health()
        if problem is not None:  # a dead scheduler thread or a failing step is never silent
            return JSONResponse({"status": "unhealthy", "error": problem}, status_code=503)
        return Response(status_code=200)

    async def health_generate(self, request: Request):
        engine = self.engine
        if engine.scheduler.dead:
            return JSONResponse({"status": "unhealthy", "error": engine.scheduler.dead}, status_code=503)
        if engine.scheduler.paused_mode is not None:
            return Response(status_code=200)  # paused is healthy; a probe must not wait for continue
        try:
            req = protocol.parse_generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1}})
            sink = _HttpSink(asyncio.get_running_loop(), engine, False)
            seq = engine.make_sequences(req, lambda _item: sink)[0]
            engine.submit(seq)
            result = await asyncio.wait_for(asyncio.shield(sink.done), timeout=HEALTH_GENERATE_TIMEOUT_S)
        except Exception:
            return Response(status_code=503)
        fault = _fault_of(result)
        return Response(status_code=200) if fault is None else JSONResponse({"error": fault}, status_code=503)


def create_app(engine: Engine, guard: ServerGuard | None = None):
    """The app; ``guard``: keys and request limit (None: the engine config's, keys from the environment)."""
    app = server_app("miles-disagg built-in engine")
    install_guard(app, guard if guard is not None else engine.config.guard())
    api = EngineEndpoints(engine, ThreadPoolExecutor(max_workers=32, thread_name_prefix="engine-http"))
    get, post, get_post = ["GET"], ["POST"], ["GET", "POST"]
    routes = [
        ("/generate", api.generate, ["POST", "PUT"]),
        ("/update_weights_from_disk", api.update_weights_from_disk, post),
        ("/pull_weights", api.pull_weights, post),
        ("/load_lora_adapter", api.load_lora_adapter, post),
        ("/unload_lora_adapter", api.unload_lora_adapter, post),
        (ACTIVATE_PATH, api.activate_weights, post),
        ("/init_weights_update_group", api.init_weights_update_group, post),
        ("/update_weights_from_distributed", api.update_weights_from_distributed, post),
        ("/update_weights_from_tensor", api.update_weights_from_tensor, post),
        ("/release_memory_occupation", api.release_memory_occupation, get_post),
        ("/resume_memory_occupation", api.resume_memory_occupation, get_post),
        ("/get_weight_version", api.get_weight_version, get),
        ("/weight_checksums", api.weight_checksums, get),
        ("/destroy_weights_update_group", api.destroy_weights_update_group, post),
        ("/begin_weight_update", api.begin_weight_update, post),
        ("/end_weight_update", api.end_weight_update, post),
        ("/update_weight_version", api.update_weight_version, post),
        ("/pause_generation", api.pause_generation, post),
        ("/continue_generation", api.continue_generation, post),
        ("/flush_cache", api.flush_cache, get_post),
        ("/abort_request", api.abort_request, post),
        # newer SGLang also serves these as /model_info and /server_info (miles tries /model_info first)
        ("/get_model_info", engine.model_info, get),
        ("/model_info", engine.model_info, get),
        ("/get_server_info", engine.server_info, get),
        ("/server_info", engine.server_info, get),
        ("/health", api.health, get_post),
        ("/health_generate", api.health_generate, get_post),
    ]
    for path, endpoint, methods in routes:
        app.add_api_route(path, endpoint, methods=methods)
    return app


def _fault_of(result: dict) -> dict | None:
    """SGLang's error body when an internal fault (abort with a 5xx ``status_code``) ended it."""
    finish = result["meta_info"].get("finish_reason") or {}
    code = finish.get("status_code")
    if finish.get("type") != "abort" or not isinstance(code, int) or code < 500:
        return None
    return {"message": finish.get("message"), "type": finish.get("err_type"), "code": code}


def _acknowledge(path: str):
    async def handler(body: bytes) -> dict:
        parse_json(body)
        return {"success": True, "message": f"{path.strip('/')}: nothing to do for unpacked weights"}
    return handler
