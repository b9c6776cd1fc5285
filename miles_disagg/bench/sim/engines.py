"""Simulated engines: the engine's whole HTTP surface with a latency model and no model, for scale benchmarks.

One process serves many engines, each on its own port (one aiohttp app per engine, all on one event
loop), so 256 of them fit on a 2-core machine. What a run calls on an engine is answered the way the
built-in engine answers it:

* ``POST /generate`` (one prompt or a batch): after ``per_request_s + per_token_s * max_new_tokens`` (the generation waits
  while the engine is paused, as a retracted request does); ``output_ids`` of that length, ``meta_info``
  with ``weight_version`` (the version at the end), ``weight_version_start``/``_end``, ``finish_reason``
  and, with ``return_logprob``, ``output_token_logprobs`` triples. A pause in ``abort`` mode ends the
  requests in flight with ``finish_reason`` ``abort``.
* ``POST /pull_weights`` (``pull_s``) stages a version; ``POST /update_weights_from_disk`` (``load_s``)
  activates a staged one (400 otherwise: the engine serves only versions it staged);
  ``/pause_generation`` (``pause_s``), ``/continue_generation``, ``/flush_cache``, ``/abort_request``;
  ``POST /activate_weights`` does the pause, the load and the continue in one request (announced in
  every ``/pull_weights`` answer and ``/server_info``, as the built-in engine announces it). With
  ``one_call=False`` (``sim-engines --stock-activation``) an engine answers as stock SGLang attached
  directly does: no ``/activate_weights`` (404) and nothing announced, so updaters take the per-step path.
* ``GET /health``, ``/health_generate``, ``/model_info``, ``/server_info`` (and the ``/get_*`` forms),
  ``/get_weight_version``.

Keys and the request-size limit are enforced as every server of this project enforces them
(:class:`~miles_disagg.net.asgi_guard.ServerGuard`'s settings): 401 and 413 JSON. Wrong types are 400.
Nothing in production code knows an engine is simulated.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from miles_disagg.engines.activation import ACTIVATE_PATH, ONE_CALL_ANNOUNCEMENT, one_call_answer
from miles_disagg.net.asgi_guard import ServerGuard, error_body
from miles_disagg.net.auth import level_of

PAUSE_MODES = ("abort", "retract", "in_place")
MAX_NEW_TOKENS_LIMIT = 1 << 16
SIMULATED_ARCHITECTURE = "SimulatedForCausalLM"


@dataclass(frozen=True, kw_only=True)
class LatencyModel:
    """How long a simulated engine takes for each thing it does (seconds)."""

    per_request_s: float = 0.02
    """Fixed cost of one ``/generate`` (prefill, scheduling)."""
    per_token_s: float = 0.0
    """Cost of each new token of one ``/generate`` (decode)."""
    default_new_tokens: int = 16
    """``max_new_tokens`` when a request does not say."""
    pull_s: float = 0.1
    """``/pull_weights`` (materialize and verify a version while serving)."""
    pause_s: float = 0.0
    """``/pause_generation``."""
    load_s: float = 0.05
    """``/update_weights_from_disk`` (activate the staged version)."""

    def __post_init__(self) -> None:
        for name in ("per_request_s", "per_token_s", "pull_s", "pause_s", "load_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.default_new_tokens < 0:
            raise ValueError(f"default_new_tokens must be >= 0, got {self.default_new_tokens}")

    def generate_s(self, new_tokens: int) -> float:
        return self.per_request_s + self.per_token_s * new_tokens


class BadRequest(ValueError):
    """The request body is malformed; answered 400."""


@dataclass(eq=False)
class SimulatedEngine:
    """One engine's state (mutated on the fleet's event loop only)."""

    index: int
    latency: LatencyModel
    one_call: bool = True
    """Whether it serves and announces ``/activate_weights`` (False: as stock SGLang)."""
    version: int = 0
    staged: set[int] = field(default_factory=set)
    paused: bool = False
    running: int = 0
    num_served: int = 0
    abort_epoch: int = 0
    resumed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.resumed.set()

    async def generate(self, body: dict) -> dict | list[dict]:
        """One prompt, or a batch (``input_ids`` a list of lists / ``text`` a list): a list of answers,
        generated together (one request's time)."""
        if "weight_version" in body:
            raise BadRequest("weight_version: an engine serves the version it holds and ignores constraints; send "
                             "constrained requests to the router, or drop the field")
        new_tokens = _new_tokens(body, self.latency.default_new_tokens)
        prompt_tokens, batched = _prompt_tokens(body)
        self.running += len(prompt_tokens)
        epoch = self.abort_epoch  # a pause in abort mode ends what is queued too
        try:
            await self.resumed.wait()
            start_version = self.version
            await asyncio.sleep(self.latency.generate_s(new_tokens))
            await self.resumed.wait()  # a retracted request resumes after the pause
        finally:
            self.running -= len(prompt_tokens)
        aborted = epoch != self.abort_epoch
        answers = []
        for count in prompt_tokens:
            self.num_served += 1
            answers.append(self._answer(body, start_version, 0 if aborted else new_tokens, count, aborted))
        return answers if batched else answers[0]

    def _answer(self, body: dict, start_version: int, new_tokens: int, prompt_tokens: int, aborted: bool) -> dict:
        meta: dict[str, Any] = {
            "id": f"sim-{self.index}-{self.num_served}",
            "finish_reason": {"type": "abort"} if aborted else {"type": "length", "length": new_tokens},
            "prompt_tokens": prompt_tokens, "completion_tokens": new_tokens,
            "weight_version": str(self.version),
            "weight_version_start": start_version, "weight_version_end": self.version,
        }
        output_ids = [(self.index + i) % 8 + 2 for i in range(new_tokens)]  # ids every tokenizer has
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.5, token, None] for token in output_ids]
        return {"text": " ".join(map(str, output_ids)), "output_ids": output_ids, "meta_info": meta}

    async def pull(self, body: dict) -> dict:
        version = _version_field(body, "target_version")
        for name in ("source_dir", "local_checkpoint_dir"):
            if not isinstance(body.get(name), str) or "\x00" in body[name]:
                raise BadRequest(f"{name} must be a path string without NUL bytes, got {body.get(name)!r}")
        await asyncio.sleep(self.latency.pull_s)
        self.staged.add(version)
        answer = {"success": True, "message": f"staged version {version}", "version": version}
        return {**answer, "miles_disagg": ONE_CALL_ANNOUNCEMENT} if self.one_call else answer

    async def activate(self, body: dict) -> dict:
        """``/activate_weights``: pause, load the staged version, continue, in one request (the pause is
        timed here, as the built-in engine times its own)."""
        mode = body.get("pause_mode", "retract")
        version = _version_field(body, "weight_version", text=True)
        if version not in self.staged:
            raise BadRequest(f"version {version} was not staged by /pull_weights (staged: {sorted(self.staged)})")
        started = time.perf_counter()
        await self.pause({"mode": mode})
        try:
            await self.load({"model_path": body.get("model_path") or "simulated", "weight_version": str(version)})
        finally:
            await self.resume({})
        return one_call_answer(version, time.perf_counter() - started)

    async def pause(self, body: dict) -> dict:
        mode = body.get("mode", "retract")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        await asyncio.sleep(self.latency.pause_s)
        self.paused = True
        self.resumed.clear()
        if mode == "abort":
            self.abort_epoch += 1
        return {"success": True, "message": f"paused ({mode})"}

    async def resume(self, _body: dict) -> dict:
        self.paused = False
        self.resumed.set()
        return {"success": True, "message": "continued"}

    async def load(self, body: dict) -> dict:
        path = body.get("model_path")
        if not isinstance(path, str) or "\x00" in path:
            raise BadRequest(f"model_path must be a path string without NUL bytes, got {path!r}")
        version = _version_field(body, "weight_version", text=True)
        if version not in self.staged:
            raise BadRequest(f"version {version} was not staged by /pull_weights (staged: {sorted(self.staged)})")
        await asyncio.sleep(self.latency.load_s)
        self.version = version
        self.staged = {v for v in self.staged if v > version}
        return {"success": True, "message": f"loaded version {version}", "num_paused_requests": 0}

    def model_info(self) -> dict:
        return {"model_path": "simulated", "tokenizer_path": None, "is_generation": True,
                "weight_version": str(self.version), "architectures": [SIMULATED_ARCHITECTURE],
                "model_type": "simulated"}

    def server_info(self) -> dict:
        return {"tp_size": 1, "dtype": "bfloat16", "context_length": 1 << 20, "weight_version": str(self.version),
                "internal_states": [{"num_running_requests": self.running, "num_waiting_requests": 0}],
                "miles_disagg": {"simulated": True, "delta_filters": [],
                                 **(ONE_CALL_ANNOUNCEMENT if self.one_call else {})}}


def _new_tokens(body: dict, default: int) -> int:
    sampling = body.get("sampling_params", {})
    if not isinstance(sampling, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(sampling).__name__}")
    value = sampling.get("max_new_tokens", default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_NEW_TOKENS_LIMIT:
        raise BadRequest(f"sampling_params.max_new_tokens must be an integer in [0, {MAX_NEW_TOKENS_LIMIT}], "
                         f"got {value!r}")
    return value


def _prompt_tokens(body: dict) -> tuple[list[int], bool]:
    """Each prompt's length, and whether the body is a batch."""
    ids, text = body.get("input_ids"), body.get("text")
    if isinstance(ids, list) and ids and all(isinstance(item, list) for item in ids):
        return [len(item) for item in ids], True
    if isinstance(ids, list):
        return [len(ids)], False
    if isinstance(text, list) and text and all(isinstance(item, str) for item in text):
        return [len(item.split()) for item in text], True
    if isinstance(text, str):
        return [len(text.split())], False
    raise BadRequest("give input_ids (token ids, or a list of them) or text (a string, or a list of them)")


def _version_field(body: dict, name: str, *, text: bool = False) -> int:
    """A version: an int (``text``: or a decimal string, as SGLang's ``weight_version``)."""
    value = body.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if text and isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    kind = "a non-negative integer" + (" or decimal string" if text else "")
    raise BadRequest(f"{name} must be {kind}, got {value!r}")


# --------------------------------------------------------------------------- HTTP


def make_app(engine: SimulatedEngine, guard: ServerGuard):
    """One engine's aiohttp app (keys, size limit, JSON errors)."""
    from aiohttp import web

    app = web.Application(middlewares=[_guard_middleware(guard)],
                          client_max_size=guard.max_request_bytes or 1 << 62)
    posts = {"/generate": engine.generate, "/pull_weights": engine.pull, "/pause_generation": engine.pause,
             "/continue_generation": engine.resume, "/update_weights_from_disk": engine.load,
             "/flush_cache": _ok, "/abort_request": _ok}
    if engine.one_call:
        posts[ACTIVATE_PATH] = engine.activate
    gets = {"/health": lambda: {}, "/health_generate": lambda: {},
            "/model_info": engine.model_info, "/get_model_info": engine.model_info,
            "/server_info": engine.server_info, "/get_server_info": engine.server_info,
            "/get_weight_version": lambda: {"weight_version": str(engine.version)}}
    for path, handler in posts.items():
        app.router.add_post(path, _post_handler(handler))
    for path, getter in gets.items():
        app.router.add_get(path, _get_handler(getter))
    app.router.add_get("/flush_cache", _get_handler(lambda: {"success": True}))
    return app


async def _ok(_body: dict) -> dict:
    return {"success": True}


def _json_response(status: int, body: Any):
    from aiohttp import web

    return web.Response(status=status, body=json.dumps(body).encode(), content_type="application/json")


def _post_handler(handler):
    async def handle(request):
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
            if not isinstance(body, dict):
                raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
            return _json_response(200, await handler(body))
        except (ValueError, RecursionError) as exc:  # BadRequest, JSONDecodeError, UnicodeDecodeError
            return _json_response(400, error_body(400, "BadRequest", str(exc)))
    return handle


def _get_handler(getter):
    async def handle(_request):
        return _json_response(200, getter())
    return handle


def _guard_middleware(guard: ServerGuard):
    from aiohttp import web

    @web.middleware
    async def guarded(request, handler):
        if guard.keys.caller_level(level_of(request.path), request.headers.get("Authorization")) is None:
            return _json_response(401, error_body(401, "Unauthorized", f"{request.path} needs this server's key"))
        limit = guard.max_request_bytes
        if limit and request.content_length is not None and request.content_length > limit:
            return _json_response(413, error_body(413, "RequestTooLarge",
                                                  f"Content-Length is {request.content_length}; the limit is {limit}"))
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _json_response(413, error_body(413, "RequestTooLarge", f"more than {limit} bytes were sent"))
    return guarded


class SimulatedFleet:
    """``num_engines`` simulated engines on one event loop, each on its own port of ``host``."""

    def __init__(self, num_engines: int, latency: LatencyModel, *, host: str = "127.0.0.1",
                 guard: ServerGuard | None = None, one_call: bool = True):
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.host, self.latency = host, latency
        self.guard = guard if guard is not None else ServerGuard.from_env()
        self.engines = [SimulatedEngine(i, latency, one_call) for i in range(num_engines)]
        self.urls: list[str] = []
        self._runners: list = []

    async def start(self, base_port: int = 0) -> list[str]:
        """Bind every engine (``base_port`` + its index; 0: a free port each); returns their URLs in engine order."""
        from aiohttp import web

        for engine in self.engines:
            runner = web.AppRunner(make_app(engine, self.guard), access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, self.host, base_port + engine.index if base_port else 0, backlog=1024)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # aiohttp exposes the bound port only here
            self._runners.append(runner)
            self.urls.append(f"http://{self.host}:{port}")
        return list(self.urls)

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
