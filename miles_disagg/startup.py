"""Process start-up without Python's cyclic garbage collector.

Every process of this project (driver, engines, router, agent, gateway, replicas, trainer ranks and
the other Ray actors, CLI commands) imports this package before torch, ray or transformers. Those
imports build millions of objects, and the cyclic collector keeps scanning them while they are made:
a sixth of a short run's CPU (a 6-step tiny run, side by side: 24.5 -> 20.5 CPU-seconds). So the
collector is off for a process's first :data:`STARTUP_S` seconds and on again after them. Reference
counting, which frees almost everything, is untouched: only garbage that forms cycles during those
seconds waits for the first collection after them (``gc.collect()`` still works at any time).

A process that turned the collector off itself is left as it is.
"""

from __future__ import annotations

import gc
import threading

STARTUP_S = 30.0

_started = False


def start_without_cyclic_gc(seconds: float = STARTUP_S) -> None:
    """Turn the cyclic collector off now and on again after ``seconds`` (once per process)."""
    global _started
    if _started or not gc.isenabled():
        return
    _started = True
    gc.disable()
    timer = threading.Timer(seconds, gc.enable)
    timer.daemon = True  # never holds a process's exit
    timer.name = "miles-disagg-gc-after-startup"
    timer.start()
