"""The generation hot path's HTTP client, side by side: ``httpx.AsyncClient`` (what the rollout
manager used, and the router still uses) against ``pooled_http.PooledSession`` (what the rollout
manager uses now), each
sending the same requests at the same concurrency to one local uvicorn server whose
``/generate`` answers after a fixed delay (an engine's time per request).

Reports, per client, requests per second and the client process's CPU milliseconds per request
(the server runs in its own process and is not counted), and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any

from miles_disagg.bench.common import print_result, progress, work_dir
from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import flag
from miles_disagg.net.process import free_port, start_http_process

say = progress("http")


@dataclass(kw_only=True)
class HttpBench:
    """the generation hot path's HTTP client: httpx vs pooled_http"""

    json: bool = flag(False, "Print the result as JSON (always on; kept for scripts).")
    concurrency: int = flag(128, "Requests in flight (the rollout manager's --rollout-concurrency).")
    requests: int = flag(4000, "Requests each client sends.")
    delay_ms: float = flag(20.0, "The server's time per request, in milliseconds.", metavar="MS")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, HttpBench)


async def echo_app(scope: dict, receive: Any, send: Any) -> None:
    """The bench server: ``/health`` answers at once; ``POST /generate`` after ``?delay_ms``."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/generate":
        await asyncio.sleep(float(scope["query_string"].decode().partition("=")[2] or 0) / 1000)
    answer = b'{"text": "7 8", "output_ids": [7, 8], "meta_info": {"weight_version": "3"}}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


async def _drive(client: Any, url: str, requests: int, concurrency: int) -> None:
    body = {"input_ids": list(range(32)), "sampling_params": {"max_new_tokens": 2}}
    left = iter(range(requests))

    async def worker() -> None:
        for _ in left:
            reply = await client.post(url, json=body)
            if reply.status_code != 200:
                raise RuntimeError(f"the bench server answered {reply.status_code}")
            reply.json()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.aclose()


def _measure(kind: str, url: str, args: HttpBench) -> dict[str, float]:
    async def main() -> None:
        if kind == "httpx":
            import httpx

            limits = httpx.Limits(max_connections=args.concurrency + 8, keepalive_expiry=2.0)
            client = httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0), limits=limits, trust_env=False)
        else:
            from miles_disagg.net.pooled_http import PooledSession

            client = PooledSession(max_connections=args.concurrency + 8, connect_timeout_s=10.0, read_timeout_s=900.0)
        await _drive(client, url, args.requests, args.concurrency)

    cpu, wall = time.process_time(), time.perf_counter()
    asyncio.run(main())
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    say(f"{kind}: {args.requests} requests in {wall:.1f}s, {cpu:.1f} CPU-s")
    return {"requests_per_s": round(args.requests / wall, 1), "client_cpu_ms_per_request": round(1000 * cpu / args.requests, 3)}


def run(namespace: argparse.Namespace) -> int:
    args = config_from_args(HttpBench, namespace)
    if min(args.concurrency, args.requests) < 1 or args.delay_ms < 0:
        print("bench http: --concurrency and --requests must be at least 1, --delay-ms at least 0", file=sys.stderr)
        return 2
    with work_dir("http", None) as root:
        port = free_port()
        server = start_http_process(
            [sys.executable, "-m", "uvicorn", "miles_disagg.bench.http_client:echo_app", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning", "--backlog", "2048"],
            url=f"http://127.0.0.1:{port}", log_path=root / "server.log", health_path="/health",
            what="the bench server", error=RuntimeError, startup_timeout_s=60.0)
        try:
            url = f"{server.url}/generate?delay_ms={args.delay_ms:g}"
            result = {kind: _measure(kind, url, args) for kind in ("httpx", "pooled_http")}
        finally:
            server.stop()
    result["cpu_per_request_ratio_httpx_over_pooled"] = round(
        result["httpx"]["client_cpu_ms_per_request"] / result["pooled_http"]["client_cpu_ms_per_request"], 2)
    result["throughput_ratio_pooled_over_httpx"] = round(
        result["pooled_http"]["requests_per_s"] / result["httpx"]["requests_per_s"], 2)
    result["config"] = {"concurrency": args.concurrency, "requests": args.requests, "delay_ms": args.delay_ms}
    return print_result(result)
