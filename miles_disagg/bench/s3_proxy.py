"""A fault-injecting, WAN-emulating HTTP/1.1 reverse proxy in front of one S3-API server.

``S3Proxy(upstream_url).start()`` listens on 127.0.0.1 (a free port, ``.url``). Each request is
forwarded over a fresh upstream connection exactly as received (method, target, every header,
Host and the SigV4 headers included: botocore signed the proxy's host:port); bodies stream both
ways in pieces of at most ``PIECE_BYTES`` (Content-Length and chunked framing copied raw), never
whole in memory. Response heads come back unchanged but for the hop-by-hop ``Connection`` and
``Keep-Alive`` headers, which describe the proxy's own client connection: a client connection is
kept alive across requests (HTTP/1.1, no ``Connection: close``) whatever the upstream does.

Everything a test or benchmark sets (faults, the link, counters) takes effect at once, from any
thread. Standard library only: one daemon thread accepts, one daemon thread serves each client
connection; ``stop()`` ends them all within ``STOP_TIMEOUT_S``.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable
from urllib.parse import urlsplit

PIECE_BYTES = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024
STOP_TIMEOUT_S = 1.0
UPSTREAM_TIMEOUT_S = 60.0
CONTINUE_WAIT_S = 1.0  # as botocore: how long a server may take to answer ``Expect: 100-continue``
PACE_SLICE_S = 0.02  # the longest one paced write holds the link
FAULT_KINDS = ("slowdown", "error500", "reset_mid_body", "stall")
ANSWERS = {  # the faults answered by the proxy itself: (status line, S3 error code, message)
    "slowdown": (b"503 Slow Down", "SlowDown", "Please reduce your request rate."),
    "error500": (b"500 Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
}
Send = Callable[[bytes], None]


class _ClientReset(Exception):
    """A ``reset_mid_body`` fault fired: the client connection ends with an RST."""


@dataclass(kw_only=True)
class Fault:
    """A rule: the first ``times`` requests matching ``method`` (None: any) and ``path_contains``
    (a substring of the request target, query included; None: any) get ``kind``:
    ``slowdown`` (503 SlowDown, upstream never contacted), ``error500`` (500 InternalError, likewise),
    ``reset_mid_body`` (forwarded; the client gets the response head and about half the body, then
    an RST), ``stall`` (forwarded after ``seconds``)."""

    kind: str
    method: str | None = None
    path_contains: str | None = None
    times: int = 1
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"Fault kind {self.kind!r}: expected one of {FAULT_KINDS}")
        if self.times < 1:
            raise ValueError(f"Fault times={self.times}: expected at least 1")
        if self.seconds < 0 or (self.kind == "stall") != (self.seconds > 0):
            raise ValueError(f"Fault seconds={self.seconds}: a stall needs seconds > 0, other kinds none")

    def matches(self, method: str, target: str) -> bool:
        return (self.method is None or self.method.upper() == method) and \
            (self.path_contains is None or self.path_contains in target)


@dataclass
class MessageHead:
    """A message's start line and headers, ``raw`` exactly as received."""

    raw: bytes
    start: list[str]
    headers: dict[str, str]  # lower-cased names; a repeated header keeps its last value

    def tokens(self, name: str) -> set[str]:
        return {token.strip().lower() for token in self.headers.get(name, "").split(",")}

    def body_framing(self) -> str:
        """``chunked``, ``length`` or ``none`` (a response without either reads to the close)."""
        if "chunked" in self.tokens("transfer-encoding"):
            return "chunked"
        return "length" if "content-length" in self.headers else "none"


def read_head(reader: BinaryIO) -> MessageHead | None:
    """The next head on ``reader``; None at a clean end of stream before its first byte."""
    raw = bytearray()
    while True:
        line = reader.readline(MAX_HEAD_BYTES + 1)
        if not line:
            if raw:
                raise ConnectionError("the stream ended inside a message head")
            return None
        raw += line
        if len(raw) > MAX_HEAD_BYTES:
            raise ConnectionError(f"a message head over {MAX_HEAD_BYTES} bytes")
        if line in (b"\r\n", b"\n") and len(raw) > len(line):
            break
        if line in (b"\r\n", b"\n"):
            raw.clear()  # a stray empty line before a message is allowed (RFC 9112 2.2)
    lines = bytes(raw).decode("latin-1").splitlines()
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return MessageHead(bytes(raw), lines[0].split(" ", 2), headers)


def copy_exactly(reader: BinaryIO, num_bytes: int, send: Send) -> None:
    while num_bytes > 0:
        piece = reader.read(min(PIECE_BYTES, num_bytes))
        if not piece:
            raise ConnectionError(f"the stream ended {num_bytes} bytes short of its body")
        send(piece)
        num_bytes -= len(piece)


def copy_chunked(reader: BinaryIO, send: Send) -> None:
    """A chunked body, framing and trailers included, byte for byte."""
    while True:
        size_line = reader.readline(MAX_HEAD_BYTES)
        if not size_line.endswith(b"\n"):
            raise ConnectionError("the stream ended inside a chunk size line")
        send(size_line)
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            break
        copy_exactly(reader, size + 2, send)  # the chunk and its CRLF
    while True:  # trailers, up to the empty line
        line = reader.readline(MAX_HEAD_BYTES)
        if not line:
            raise ConnectionError("the stream ended inside a chunked body's trailers")
        send(line)
        if line in (b"\r\n", b"\n"):
            return


def copy_to_close(reader: BinaryIO, send: Send) -> None:
    while piece := reader.read1(PIECE_BYTES):
        send(piece)


class _Link:
    """One pipe shared by every connection in both directions: a virtual clock of when it is next free."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bandwidth_bytes_per_s: float | None = None
        self.rtt_s = 0.0
        self._free_at_s = 0.0

    def set(self, bandwidth_bytes_per_s: float | None, rtt_s: float) -> None:
        if bandwidth_bytes_per_s is not None and bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s}: expected > 0 or None")
        if rtt_s < 0:
            raise ValueError(f"rtt_s={rtt_s}: expected >= 0")
        with self._lock:
            self.bandwidth_bytes_per_s, self.rtt_s = bandwidth_bytes_per_s, rtt_s
            self._free_at_s = time.monotonic()

    def slice_bytes(self) -> int:
        bandwidth = self.bandwidth_bytes_per_s
        return PIECE_BYTES if bandwidth is None else max(1024, min(PIECE_BYTES, int(bandwidth * PACE_SLICE_S)))

    def reserve(self, num_bytes: int) -> float:
        """Seconds to wait until ``num_bytes`` have crossed the link (booked now, first come first served)."""
        with self._lock:
            if self.bandwidth_bytes_per_s is None:
                return 0.0
            now = time.monotonic()
            self._free_at_s = max(now, self._free_at_s) + num_bytes / self.bandwidth_bytes_per_s
            return self._free_at_s - now


class S3Proxy:
    """See the module docstring. Thread-safe: every public method may be called from any thread."""

    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream_url {upstream_url!r}: expected http://host:port")
        self._upstream = (parts.hostname, parts.port or 80)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._link = _Link()
        self._faults: list[list] = []  # [Fault, remaining times]
        self._fired: dict[str, int] = {}
        self._counts = {"to_client": 0, "from_client": 0, "requests": 0}
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._listener: socket.socket | None = None
        self.url = ""

    # -- what tests and benchmarks call ----------------------------------------------------------

    def start(self) -> "S3Proxy":
        """Listen on a free port of 127.0.0.1; returns self, with ``.url`` set."""
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)  # the accept loop sees stop() within this
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._spawn(self._accept_loop)
        return self

    def stop(self) -> None:
        """Close the listener and every connection; returns once every thread of the proxy has
        ended, or after ``STOP_TIMEOUT_S`` (the threads are daemons either way)."""
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
            except OSError:
                pass
        deadline_s = time.monotonic() + STOP_TIMEOUT_S
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline_s - time.monotonic()))

    def __enter__(self) -> "S3Proxy":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def add_fault(self, fault: Fault) -> None:
        """Rules are tried in the order added; a request takes the first matching rule not yet spent."""
        with self._lock:
            self._faults.append([fault, fault.times])

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def faults_fired(self) -> dict[str, int]:
        """Requests each fault kind has fired on since start."""
        with self._lock:
            return dict(self._fired)

    def set_link(self, bandwidth_bytes_per_s: float | None, rtt_s: float = 0.0) -> None:
        """Every request waits ``rtt_s`` before anything else (faults included); every byte either
        way is paced to ``bandwidth_bytes_per_s`` shared by all connections (None: unlimited)."""
        self._link.set(bandwidth_bytes_per_s, rtt_s)

    @property
    def bytes_to_client(self) -> int:
        return self._counts["to_client"]

    @property
    def bytes_from_client(self) -> int:
        return self._counts["from_client"]

    @property
    def requests(self) -> int:
        return self._counts["requests"]

    def reset_counters(self) -> None:
        with self._lock:
            self._counts = dict.fromkeys(self._counts, 0)

    # -- threads and sockets ---------------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=self._run_tracked, args=(target, *args), daemon=True, name="s3-proxy")
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def _run_tracked(self, target: Callable[..., None], *args: object) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _track(self, sock: socket.socket, live: bool) -> None:
        with self._lock:
            (self._sockets.add if live else self._sockets.discard)(sock)
        if live and self._stopped.is_set():
            raise ConnectionAbortedError("the proxy stopped")  # stop() has passed its sweep

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed: stop()
            sock.settimeout(None)
            self._spawn(self._serve_connection, sock)

    def _count(self, key: str, num: int) -> None:
        with self._lock:
            self._counts[key] += num

    def _paced_sender(self, sock: socket.socket, count_key: str | None) -> Send:
        def send(data: bytes) -> None:
            view, slice_bytes = memoryview(data), self._link.slice_bytes()
            while view:
                piece, view = view[:slice_bytes], view[slice_bytes:]
                if self._stopped.wait(self._link.reserve(len(piece))):
                    raise ConnectionAbortedError("the proxy stopped")
                sock.sendall(piece)
                if count_key:
                    self._count(count_key, len(piece))
        return send

    def _counted(self, send: Send) -> Send:
        """``send`` that first counts the bytes as read from the client."""
        def counted(data: bytes) -> None:
            self._count("from_client", len(data))
            send(data)
        return counted

    def _take_fault(self, method: str, target: str) -> Fault | None:
        with self._lock:
            for rule in self._faults:
                if rule[1] > 0 and rule[0].matches(method, target):
                    rule[1] -= 1
                    self._fired[rule[0].kind] = self._fired.get(rule[0].kind, 0) + 1
                    return rule[0]
        return None

    # -- one client connection -------------------------------------------------------------------

    def _serve_connection(self, sock: socket.socket) -> None:
        self._track(sock, True)
        reader = sock.makefile("rb", buffering=PIECE_BYTES)
        to_client = self._paced_sender(sock, "to_client")
        reset = False
        try:
            while not self._stopped.is_set():
                head = read_head(reader)
                if head is None or len(head.start) != 3:
                    return
                self._count("from_client", len(head.raw))
                self._count("requests", 1)
                if not self._serve_request(reader, to_client, head):
                    return
        except _ClientReset:
            reset = True
        except (OSError, ValueError):
            pass  # the client or the upstream went away, or sent what is not HTTP: end this connection
        finally:
            self._track(sock, False)
            reader.close()
            if reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()

    def _serve_request(self, reader: BinaryIO, to_client: Send, head: MessageHead) -> bool:
        """Answer one request; True when the client connection stays open for the next."""
        self._stopped.wait(self._link.rtt_s)  # the request crossing the link
        fault = self._take_fault(head.start[0], head.start[1])
        kind = fault.kind if fault else None
        if kind == "stall":
            self._stopped.wait(fault.seconds)
        if self._stopped.is_set():
            return False
        if kind in ANSWERS:
            return self._answer_fault(reader, to_client, head, kind)
        return self._forward(reader, to_client, head, reset=kind == "reset_mid_body")

    def _answer_fault(self, reader: BinaryIO, to_client: Send, head: MessageHead, kind: str) -> bool:
        has_body = head.body_framing() != "none"
        expects_continue = has_body and "100-continue" in head.tokens("expect")
        if has_body and not expects_continue:  # drained, so that the connection can carry the next request
            self._copy_request_body(reader, head, self._counted(lambda data: None))
        status, code, message = ANSWERS[kind]
        body = f"<?xml version='1.0' encoding='UTF-8'?>\n<Error><Code>{code}</Code><Message>{message}</Message>" \
               f"<RequestId>s3-proxy</RequestId></Error>".encode()
        keep_alive = wants_keep_alive(head) and not expects_continue  # the client may still send the body
        to_client(b"HTTP/1.1 %s\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n%s\r\n%s" % (
            status, len(body), b"" if keep_alive else b"Connection: close\r\n",
            b"" if head.start[0] == "HEAD" else body))
        return keep_alive

    def _copy_request_body(self, reader: BinaryIO, head: MessageHead, send: Send) -> None:
        framing = head.body_framing()
        if framing == "chunked":
            copy_chunked(reader, send)
        elif framing == "length":
            copy_exactly(reader, int(head.headers["content-length"]), send)

    def _forward(self, reader: BinaryIO, to_client: Send, head: MessageHead, reset: bool) -> bool:
        upstream = socket.create_connection(self._upstream, timeout=UPSTREAM_TIMEOUT_S)
        self._track(upstream, True)
        upstream_reader = upstream.makefile("rb", buffering=PIECE_BYTES)
        to_upstream = self._paced_sender(upstream, None)
        try:
            to_upstream(head.raw)
            body_sent = head.body_framing() == "none"
            response = None
            if not body_sent and "100-continue" in head.tokens("expect"):
                response = self._await_continue(upstream, upstream_reader, to_client)
            if response is None:
                self._copy_request_body(reader, head, self._counted(to_upstream))
                body_sent = True
                response = self._final_head(upstream_reader, to_client)
            return self._relay_response(upstream_reader, to_client, head, response, reset) and body_sent
        finally:
            self._track(upstream, False)
            upstream_reader.close()
            upstream.close()

    def _await_continue(self, upstream: socket.socket, upstream_reader: BinaryIO, to_client: Send) -> MessageHead | None:
        """The final response if the server answered before the body (it will not be sent), else
        None: the server sent 100 Continue (passed on to the client) or said nothing in time."""
        if not select.select([upstream], [], [], CONTINUE_WAIT_S)[0]:
            return None
        response = read_head(upstream_reader)
        if response is None:
            raise ConnectionError("the upstream closed without a response")
        if is_interim(response):
            to_client(response.raw)
            return None
        return response

    def _final_head(self, upstream_reader: BinaryIO, to_client: Send) -> MessageHead:
        """The response's final head; interim (1xx) heads before it go to the client as they are."""
        while True:
            response = read_head(upstream_reader)
            if response is None:
                raise ConnectionError("the upstream closed without a response")
            if not is_interim(response):
                return response
            to_client(response.raw)

    def _relay_response(self, upstream_reader: BinaryIO, to_client: Send, request: MessageHead, response: MessageHead,
                        reset: bool) -> bool:
        bodyless = request.start[0] == "HEAD" or response.start[1] in ("204", "304")
        framing = "empty" if bodyless else response.body_framing()
        keep_alive = wants_keep_alive(request) and framing != "none"
        to_client(client_head(response.raw, keep_alive))
        if reset:
            length = int(response.headers.get("content-length", 0)) if framing == "length" else 0
            if length > 1:
                copy_exactly(upstream_reader, length // 2, to_client)
            elif framing != "empty":
                to_client(upstream_reader.read1(PIECE_BYTES))
            raise _ClientReset()
        if framing == "chunked":
            copy_chunked(upstream_reader, to_client)
        elif framing == "length":
            copy_exactly(upstream_reader, int(response.headers["content-length"]), to_client)
        elif framing == "none":
            copy_to_close(upstream_reader, to_client)
        return keep_alive


def is_interim(response: MessageHead) -> bool:
    return response.start[1].startswith("1") and response.start[1] != "101"


def wants_keep_alive(request: MessageHead) -> bool:
    return request.start[2].strip() == "HTTP/1.1" and "close" not in request.tokens("connection")


def client_head(raw: bytes, keep_alive: bool) -> bytes:
    """A response head for the proxy's client connection: the upstream's hop-by-hop ``Connection``
    and ``Keep-Alive`` headers out, ``Connection: close`` in where the proxy will close."""
    lines = [line for line in raw.splitlines() if line]  # the head ends with an empty line
    kept = [line for line in lines if line.split(b":", 1)[0].strip().lower() not in (b"connection", b"keep-alive")]
    return b"\r\n".join(kept + ([] if keep_alive else [b"Connection: close"])) + b"\r\n\r\n"
