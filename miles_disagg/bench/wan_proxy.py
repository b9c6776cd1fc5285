"""A small HTTP/1.1 proxy in front of one S3-API server: an emulated WAN link and injected faults.

Benchmarks put it between a region's engines and the object store (``?endpoint=`` of the store URL,
or a relay's): every request waits one round trip (``rtt_s``) before it is forwarded, and the bytes of
every body, both ways, share one token bucket of ``bandwidth_bytes_per_s`` (the link between two
regions is one pipe). Tests put faults on it that a real S3 server does not make on demand:
``slowdown`` (503 SlowDown) and ``error500`` answered without forwarding, ``reset_mid_body`` (half
the answer, then a TCP reset), ``stall`` (a wait before forwarding). Each rule fires for its first
``times`` matching requests. Counters say what crossed the link.

Standard library only; one thread per client connection, requests forwarded one at a time over a
fresh upstream connection each (keep-alive to the client is kept). Bodies stream in pieces of
``PIECE_BYTES``: memory does not grow with an object's size. Loopback only: this is a benchmark and
test instrument, never a production hop.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

PIECE_BYTES = 64 * 1024
FAULT_KINDS = ("slowdown", "error500", "reset_mid_body", "stall")
_ERRORS = {"slowdown": (503, "Service Unavailable", "SlowDown", "Please reduce your request rate."),
           "error500": (500, "Internal Server Error", "InternalError", "We encountered an internal error.")}


@dataclass
class Fault:
    kind: str
    method: str | None = None
    path_contains: str | None = None
    times: int = 1
    seconds: float = 0.0  # stall only

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {self.kind!r}")

    def matches(self, method: str, path: str) -> bool:
        return self.times > 0 and (self.method in (None, method)) and (self.path_contains is None or self.path_contains in path)


class _Link:
    """One shared pipe: a token bucket of ``rate`` bytes per second (None: unlimited)."""

    def __init__(self) -> None:
        self.rate: float | None = None
        self.rtt_s = 0.0
        self._lock = threading.Lock()
        self._next_free = time.monotonic()

    def take(self, nbytes: int) -> None:
        if self.rate is None:
            return
        with self._lock:
            start = max(self._next_free, time.monotonic())
            self._next_free = start + nbytes / self.rate
            wait = self._next_free - time.monotonic()
        if wait > 0:
            time.sleep(wait)


class S3Proxy:
    """``S3Proxy(upstream_url).start()``: ``.url``; faults by :meth:`add_fault`, the link by :meth:`set_link`."""

    def __init__(self, upstream_url: str, host: str = "127.0.0.1"):
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.host = host
        self.link = _Link()
        self._faults: list[Fault] = []
        self._fired: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_to_client = self.bytes_from_client = self.requests = 0
        self._server: socket.socket | None = None
        self._stopping = threading.Event()
        self._clients: set[socket.socket] = set()  # open connections, shut down by stop()
        self._threads: list[threading.Thread] = []
        self.url = ""

    # ------------------------------------------------------------------ control

    def start(self) -> "S3Proxy":
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind((self.host, 0))
        self._server.listen(256)
        self._server.settimeout(0.2)
        self.url = f"http://{self.host}:{self._server.getsockname()[1]}"
        self._spawn(self._accept)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the listening socket and every open connection, and wait for their threads."""
        self._stopping.set()
        if self._server is not None:
            self._server.close()
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
        for thread in list(self._threads):
            thread.join(timeout_s)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name="s3-proxy", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def __enter__(self) -> "S3Proxy":
        return self if self._server is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def add_fault(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def faults_fired(self) -> dict[str, int]:
        with self._lock:
            return dict(self._fired)

    def set_link(self, bandwidth_bytes_per_s: float | None, rtt_s: float = 0.0) -> None:
        self.link.rate, self.link.rtt_s = bandwidth_bytes_per_s, rtt_s

    def reset_counters(self) -> None:
        with self._lock:
            self.bytes_to_client = self.bytes_from_client = self.requests = 0

    def _count(self, to_client: int = 0, from_client: int = 0) -> None:
        with self._lock:
            self.bytes_to_client += to_client
            self.bytes_from_client += from_client

    def _fault_for(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.requests += 1
            for fault in self._faults:
                if fault.matches(method, path):
                    fault.times -= 1
                    self._fired[fault.kind] = self._fired.get(fault.kind, 0) + 1
                    return fault
        return None

    # ------------------------------------------------------------------ serving

    def _accept(self) -> None:
        assert self._server is not None
        while not self._stopping.is_set():
            try:
                client, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                self._clients.add(client)
            self._spawn(self._serve, client)

    def _serve(self, client: socket.socket) -> None:
        reader = client.makefile("rb")
        try:
            while not self._stopping.is_set():
                head = _read_head(reader)
                if head is None:
                    return
                if not self._forward(client, reader, head):
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self._clients.discard(client)
            reader.close()
            client.close()

    def _forward(self, client: socket.socket, reader, head: bytes) -> bool:
        """One request; False when the client connection must close."""
        method, path = head.split(b" ", 2)[:2]
        fault = self._fault_for(method.decode(), path.decode(errors="replace"))
        length, chunked = _body_framing(head)
        if fault is not None and fault.kind in _ERRORS:
            _drain_body(reader, length, chunked)
            client.sendall(_error_answer(*_ERRORS[fault.kind]))
            return True
        time.sleep(self.link.rtt_s + (fault.seconds if fault is not None and fault.kind == "stall" else 0.0))
        if _expects_continue(head):  # botocore's PUTs: the proxy says "go on" itself, the server never sees it
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            head = _without_expect(head)
        upstream = socket.create_connection(self.upstream, timeout=60)
        try:
            upstream.sendall(head)
            self._count(from_client=len(head))
            self._relay_body(reader, upstream, length, chunked, outbound=True)
            return self._answer(upstream, client, reset=fault is not None and fault.kind == "reset_mid_body",
                                no_body=method == b"HEAD")
        finally:
            upstream.close()

    def _relay_body(self, reader, sink: socket.socket, length: int, chunked: bool, outbound: bool) -> None:
        for piece in _body_pieces(reader, length, chunked):
            self.link.take(len(piece))
            sink.sendall(piece)
            self._count(**({"from_client": len(piece)} if outbound else {"to_client": len(piece)}))

    def _answer(self, upstream: socket.socket, client: socket.socket, reset: bool, no_body: bool) -> bool:
        reader = upstream.makefile("rb")
        try:
            head = _read_head(reader)
            if head is None:
                return False
            length, chunked = _body_framing(head)
            if no_body or head.split(b" ", 2)[1] in (b"204", b"304") or head.startswith(b"HTTP/1.1 1"):
                length, chunked = 0, False
            client.sendall(head)
            self._count(to_client=len(head))
            if reset:
                half = next(_body_pieces(reader, max(1, length // 2), False), b"")
                client.sendall(half)
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return False
            self._relay_body(reader, client, length, chunked, outbound=False)
            return True
        finally:
            reader.close()


def _read_head(reader) -> bytes | None:
    lines = []
    while True:
        line = reader.readline(65537)
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)
        if len(lines) > 200:
            raise OSError("too many header lines")


def _expects_continue(head: bytes) -> bool:
    return any(line.lower().startswith(b"expect:") and b"100-continue" in line.lower() for line in head.split(b"\r\n"))


def _without_expect(head: bytes) -> bytes:
    return b"\r\n".join(line for line in head.split(b"\r\n") if not line.lower().startswith(b"expect:"))


def _body_framing(head: bytes) -> tuple[int, bool]:
    length, chunked = 0, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value.strip() or 0)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    return length, chunked


def _body_pieces(reader, length: int, chunked: bool):
    """The body's bytes as sent (chunk framing included), in pieces of at most ``PIECE_BYTES``."""
    if not chunked:
        yield from _exact_pieces(reader, length)
        return
    while True:
        size_line = reader.readline(1024)
        if not size_line:
            return
        yield size_line
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, then the blank line
                trailer = reader.readline(65537)
                yield trailer
                if trailer in (b"\r\n", b"\n", b""):
                    return
        yield from _exact_pieces(reader, size + 2)  # the chunk and its CRLF


def _exact_pieces(reader, left: int):
    """``left`` bytes of ``reader`` in pieces (fewer if it ends first)."""
    while left > 0:
        piece = reader.read(min(PIECE_BYTES, left))
        if not piece:
            return
        left -= len(piece)
        yield piece


def _drain_body(reader, length: int, chunked: bool) -> None:
    for _ in _body_pieces(reader, length, chunked):
        pass


def _error_answer(status: int, reason: str, code: str, message: str) -> bytes:
    body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message></Error>'.encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"Connection: keep-alive\r\n\r\n").encode() + body
