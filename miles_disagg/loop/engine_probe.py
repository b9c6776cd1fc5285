"""Attached engines (``--rollout-external-engine-addrs``) and a rollout service
(``--rollout-service-url``) asked before anything starts.

Every address is asked at once (one thread each). A refused connection (nothing listens there)
or an unknown host fails at once; an engine that is slow to answer (still loading, busy) is
waited for up to ``timeout_s`` with a progress line every ``PROGRESS_EVERY_S`` naming the ones
still awaited. The error names every engine that did not answer and why.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from miles_disagg.tracking import status
from miles_disagg.types import ConfigError

FLAG = "--rollout-external-engine-addrs"
PROBE_TIMEOUT_S = 120.0  # as long as the engine manager would wait for an attached engine
PROGRESS_EVERY_S = 5.0
POLL_S = 0.5
REQUEST_TIMEOUT_S = 3.0


@dataclass
class _Probe:
    addr: str  # as the user gave it (the name in every line)
    url: str
    done: threading.Event = field(default_factory=threading.Event)
    failure: str | None = None  # None with done set: answered
    last: str = "no answer yet"


def probe_engines(addrs: list[str], *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Return once every engine answered ``/health`` with 200; else ``ConfigError`` naming each one that did not."""
    probe_health([(addr, f"http://{addr}") for addr in addrs], FLAG, timeout_s=timeout_s)


def probe_service(url: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """The rollout service's endpoint answers ``/health`` (open: no key needed)."""
    probe_health([(url, url.rstrip("/"))], "--rollout-service-url", timeout_s=timeout_s)


def probe_health(targets: list[tuple[str, str]], flag: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Every ``(name, base URL)`` asked at once; ``ConfigError`` naming ``flag`` and each one that did not answer."""
    if not targets:
        return
    probes = [_Probe(name, url) for name, url in targets]
    deadline = time.monotonic() + timeout_s
    for probe in probes:
        threading.Thread(target=_ask, args=(probe, deadline), name=f"probe-{probe.addr}", daemon=True).start()
    start = last_line = time.monotonic()
    while not all(p.done.is_set() for p in probes):
        time.sleep(0.05)
        still = [p for p in probes if not p.done.is_set()]
        if still and time.monotonic() - last_line >= PROGRESS_EVERY_S:
            last_line = time.monotonic()
            status(f"waiting for {flag} to answer /health ({last_line - start:.0f}s of "
                   f"{timeout_s:.0f}s): " + "; ".join(f"{p.addr} ({p.last})" for p in still))
    failed = [p for p in probes if p.failure is not None]
    if failed:
        details = "; ".join(f"{p.addr}: {p.failure}" for p in failed)
        raise ConfigError(f"{flag}: {len(failed)} of {len(probes)} did not answer: {details}", (flag,))


def _ask(probe: _Probe, deadline: float) -> None:
    import httpx

    try:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
            while True:
                try:
                    response = client.get(f"{probe.url}/health")
                    if response.status_code == 200:
                        return
                    probe.last = f"/health answered {response.status_code}"
                except httpx.ConnectError as exc:  # refused, unreachable, unknown host: nothing to wait for
                    probe.failure = f"cannot connect ({_reason(exc)})"
                    return
                except httpx.HTTPError as exc:
                    probe.last = _reason(exc)
                if time.monotonic() + POLL_S >= deadline:
                    probe.failure = f"no answer within the wait ({probe.last})"
                    return
                time.sleep(POLL_S)
    except Exception as exc:  # noqa: BLE001 - a malformed address: named, never a hang
        probe.failure = f"{type(exc).__name__}: {exc}"
    finally:
        probe.done.set()


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
