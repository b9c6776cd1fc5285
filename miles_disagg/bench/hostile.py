"""``miles-disagg bench hostile``: what oversized and hostile bodies cost a built-in engine and a router.

Makes a tiny Qwen3 in a temp dir, starts the built-in engine and a router in front of it (both with
``--max-request-bytes`` of ``--max-request-mb`` MiB; default: the servers' own default, 32 MiB), and
while a probe thread asks ``/health`` every ``--probe-interval`` seconds, sends:

* ``declared``: a ``--body-mb`` MB ``/generate`` body with its ``Content-Length`` (413 expected);
* ``chunked``: the same size streamed without a length (413 expected);
* ``input_ids``: an ``input_ids`` list just under the request limit (parsed off the event loop;
  400 expected: longer than the context);
* ``long_text``: a ``text`` prompt just under the limit (refused before tokenizing; 400 expected);
* ``router``: the declared body through the router (413 expected).

For each: the status, the seconds to the answer, the engine's resident-memory growth (peak RSS,
``VmHWM``, after minus RSS before) and the slowest ``/health`` answer seen meanwhile. Prints
one JSON object on stdout; progress goes to stderr. Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from miles_disagg.bench.common import print_result, progress, work_dir
from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import flag
from miles_disagg.net.asgi_guard import DEFAULT_MAX_REQUEST_BYTES

MB = 1 << 20


@dataclass(kw_only=True)
class HostileBench:
    """cost of oversized and hostile bodies to the engine and the router"""

    json: bool = flag(False, "Print the result as JSON (always on; kept for scripts).")
    body_mb: int = flag(50, "Size of the oversized bodies, in MiB.")
    probe_interval: float = flag(0.05, "Seconds between /health probes while a body is sent.", metavar="S")
    max_request_mb: int = flag(DEFAULT_MAX_REQUEST_BYTES // MB, "The engine's and the router's --max-request-bytes, "
                               "in MiB (the under-limit bodies are 1 MiB less).", metavar="MB")
    work_dir: Path | None = flag(None, "Keep the model and logs here (default: a temp dir).")

    def __post_init__(self) -> None:
        if self.max_request_mb < 2 or self.body_mb < 1:
            raise ValueError(f"--max-request-mb must be >= 2 and --body-mb >= 1, got {self.max_request_mb}, "
                             f"{self.body_mb}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, HostileBench)


_progress = progress("hostile")


def run(args: argparse.Namespace) -> int:
    command = config_from_args(HostileBench, args)
    with work_dir("hostile", command.work_dir) as root:
        result = _bench(root, command)
    return print_result(result)


def _bench(root: Path, command: HostileBench) -> dict:
    from miles_disagg.engines.launch import launch_engine
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3
    from miles_disagg.router.launch import launch_router

    model = make_tiny_qwen3(root / "model")
    _progress("starting the built-in engine and a router")
    limit = command.max_request_mb * MB
    engine = launch_engine(model, log_path=root / "engine.log", extra_args=["--max-request-bytes", str(limit)])
    router = launch_router(log_path=root / "router.log", workers=[engine.url],
                           extra_args=["--max-request-bytes", str(limit)])
    size, under = command.body_mb * MB, limit - MB
    cases: dict[str, Callable[[], tuple[str, object]]] = {
        "declared": lambda: (engine.url, b" " * size),
        "chunked": lambda: (engine.url, _chunks(size)),
        "input_ids": lambda: (engine.url, _ids_body(under)),
        "long_text": lambda: (engine.url, b'{"text": "' + b"1" * (under - 20) + b'"}'),
        "router": lambda: (router.url, b" " * size),
    }
    try:
        results = {name: _measure(engine, *make(), command.probe_interval) for name, make in cases.items()}
    finally:
        router.stop()
        engine.stop()
    return {"body_mb": command.body_mb, "max_request_bytes": limit, "cases": results}


def _chunks(total: int, size: int = MB) -> Iterator[bytes]:
    for _ in range(total // size):
        yield b" " * size


def _ids_body(limit: int) -> bytes:
    count = (limit - 64) // 2  # "1," per id
    return b'{"input_ids": [' + b"1," * (count - 1) + b'1], "sampling_params": {"max_new_tokens": 1}}'


def _measure(engine, url: str, content, probe_interval_s: float) -> dict:
    import httpx

    pid = engine.proc.pid
    rss_before = _status_kb(pid, "VmRSS")
    _reset_peak(pid)
    slowest = _HealthProbe(engine.url, probe_interval_s)
    slowest.start()
    start = time.perf_counter()
    try:
        response = httpx.post(f"{url}/generate", content=content, timeout=300, trust_env=False,
                              headers={"content-type": "application/json"})
        status, message = response.status_code, _message(response)
    except httpx.HTTPError as exc:
        status, message = None, f"{type(exc).__name__}: {exc}"
    elapsed = time.perf_counter() - start
    slowest.stop()
    peak = _status_kb(pid, "VmHWM")
    _progress(f"{url}: {status} in {elapsed:.3f}s, health max {slowest.max_s:.3f}s")
    return {"status": status, "seconds": round(elapsed, 4), "message": message[:160],
            "rss_growth_mb": round(max(0, peak - rss_before) / 1024, 1), "health_max_s": round(slowest.max_s, 4),
            "health_failures": slowest.failures}


def _message(response) -> str:
    try:
        body = response.json()
        return str(body.get("message") or body.get("error", {}).get("message"))
    except ValueError:
        return response.text


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak(pid: int) -> None:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0), so the next peak is this case's alone."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass  # not permitted: the peak then covers every case so far (an over-estimate)


class _HealthProbe:
    """``GET /health`` in a loop; records the slowest answer (a failed probe counts as its timeout)."""

    def __init__(self, url: str, interval_s: float, timeout_s: float = 10.0):
        self.url, self.interval_s, self.timeout_s = url, interval_s, timeout_s
        self.max_s, self.failures = 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        import httpx

        with httpx.Client(timeout=self.timeout_s, trust_env=False) as client:
            while not self._stop.wait(self.interval_s):
                start = time.perf_counter()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.max_s = max(self.max_s, time.perf_counter() - start)
                self.failures += 0 if ok else 1
