"""How many routers a request went through: a loop of routers ends after a bounded number of hops.

A router never registers itself as its worker (its own server id), but two routers that list each
other (or a longer ring, or a router behind an agent) would bounce one request between them until
something times out. Each router forwards a request with :data:`HOPS_HEADER` one higher than it
received it (absent: 0); a request that arrives having already crossed :data:`MAX_HOPS` routers is
answered ``508 Loop Detected`` (a JSON error naming the count) and goes no further; each router on
the way back takes the worker that answered 508 out of routing (its health probes bring it back) and
relays the 508 as it is. A header that is not a small non-negative integer is ``400``. Engines and agents ignore the header (an agent
forwards it unchanged), so a request through router -> agent -> engine counts one hop.

Pure: the router's forwarding point calls :func:`hops_of` and :func:`forwarded_hops`.
"""

from __future__ import annotations

from typing import Mapping

from miles_disagg.types import InvalidInput

HOPS_HEADER = "x-miles-disagg-hops"
MAX_HOPS = 8
"""More routers than any deployment chains (a gateway, a router per pool, ...)."""
LOOP_DETECTED = 508


class RouterLoop(InvalidInput):
    """The request already went through :data:`MAX_HOPS` routers: the routers list each other."""

    def __init__(self, hops: int, limit: int = MAX_HOPS):
        self.hops, self.limit = hops, limit
        super().__init__(f"this request already went through {hops} routers ({HOPS_HEADER}), the limit is {limit}: "
                         "routers list each other as workers (a routing loop); remove the router from the other's "
                         "workers")

    def __reduce__(self):
        return type(self), (self.hops, self.limit)


def hops_of(headers: Mapping[str, str], limit: int = MAX_HOPS) -> int:
    """Routers the request went through before this one (``headers``: lower-case names, or a
    case-insensitive mapping). ``InvalidInput`` for a malformed count, :class:`RouterLoop` at or
    over ``limit``."""
    raw = headers.get(HOPS_HEADER)
    if raw is None:
        return 0
    text = raw.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 6):
        raise InvalidInput(f"header {HOPS_HEADER} must be a non-negative integer, got {raw[:40]!r}")
    hops = int(text)
    if hops >= limit:
        raise RouterLoop(hops, limit)
    return hops


def forwarded_hops(hops: int) -> dict[str, str]:
    """The header a router adds to what it forwards, having received the request after ``hops``."""
    return {HOPS_HEADER: str(hops + 1)}
