"""A server that is not an engine, and records every request it gets with its ``Authorization`` header.

What it answers is chosen per test (``answer(path) -> (status, json body)``; ``hang_s`` makes every
request wait that long first), so a test can name it as an engine and then check that no key of the
run ever reached it.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator


class RecordingServer:
    def __init__(self, answer: Callable[[str], tuple[int, Any]], hang_s: float = 0.0):
        self.answer, self.hang_s = answer, hang_s
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        self.url = ""

    @property
    def authorizations(self) -> list[str]:
        return [auth for _, _, auth in self.requests if auth is not None]


def _handler(server: RecordingServer):
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            server.requests.append((self.command, self.path, self.headers.get("Authorization")))
            if server.hang_s:
                time.sleep(server.hang_s)
            status, body = server.answer(self.path.split("?", 1)[0])
            payload = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except OSError:  # the client gave up waiting
                pass

        do_GET = do_POST = do_PUT = _serve

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@contextlib.contextmanager
def recording_server(answer: Callable[[str], tuple[int, Any]], hang_s: float = 0.0) -> Iterator[RecordingServer]:
    """Serve on a free 127.0.0.1 port in a daemon thread; yields the server (``url`` set)."""
    server = RecordingServer(answer, hang_s)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(server))
    httpd.daemon_threads = True
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()


def not_found(_path: str) -> tuple[int, Any]:
    return 404, {"detail": "Not Found"}


def empty_objects(_path: str) -> tuple[int, Any]:
    return 200, {}


def wrongly_typed(path: str) -> tuple[int, Any]:
    """Healthy, but its info is of the wrong JSON types."""
    answers = {"/health": {}, "/server_info": {"tp_size": "one", "dtype": 5, "context_length": [],
                                               "weight_store_dirs": "x"},
               "/model_info": {"architectures": 5}}
    return (200, answers[path]) if path in answers else (404, {"detail": "Not Found"})


def key_wanted(path: str) -> tuple[int, Any]:
    """Healthy, but its info endpoints want a key (as SGLang started with ``--api-key`` answers)."""
    return (200, {}) if path == "/health" else (401, {"error": "Unauthorized"})
