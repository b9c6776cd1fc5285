"""What replicas and the gateway say to each other. Pure: no I/O, no heavy imports.

A replica reports itself with ``POST {gateway}/heartbeat`` carrying a :class:`ReplicaStatus`:
periodically, and at once on every state change. The first heartbeat of a replica is
its registration; ``POST {gateway}/deregister`` ends it.

Replica states (only ``ready`` receives traffic; the gateway maps the others to its
router's ``paused``/``activating`` worker states):

* ``starting``    - its engine is being launched.
* ``catching_up`` - registered, not yet at the store's newest version (new or restarted
  replicas seed from the base or the newest anchor and apply the chain).
* ``ready``       - serving ``weight_version``, which was acknowledged after activation.
* ``activating``  - in the activation pause; the gateway sends it nothing new.
* ``failed``      - an activation failed (or the engine died): out of rotation until a
  later pass activates the store's newest version again.
* ``draining``    - shutting down: no new requests; in-flight ones finish.

Adapter versions: a replica serving a run's LoRA adapter versions names the adapter chain it
serves them from (``lora_base_dir``, its version 0); a gateway takes only replicas of its own
chain (:data:`SERVICE_INFO_PATH` announces it), and one serving full weights only replicas that
name none.

Ordering: each status carries ``incarnation`` (one per replica process) and ``seq``
(increasing within it); the gateway ignores a status older than one it already applied,
so a delayed heartbeat can never undo an activation acknowledgement.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_ACTIVATIONS_REPORTED = 8
SERVICE_INFO_PATH = "/service_info"
"""The gateway's announcement of what its replicas serve: ``{"serves": "lora_adapter_versions",
"lora_base_dir": DIR}`` or ``{"serves": "full_weight_versions", "lora_base_dir": null}``."""


class ReplicaState(str, enum.Enum):
    STARTING = "starting"
    CATCHING_UP = "catching_up"
    READY = "ready"
    ACTIVATING = "activating"
    FAILED = "failed"
    DRAINING = "draining"


# The router worker state each replica state maps to (only "ready" is routed).
ROUTER_STATE = {ReplicaState.READY: "ready", ReplicaState.ACTIVATING: "activating"}


def router_state(state: ReplicaState) -> str:
    return ROUTER_STATE.get(state, "paused")


@dataclass(frozen=True)
class StoreHead:
    """The store's newest committed version as a replica saw it."""

    version: int
    run_id: str = ""
    published_unix: float | None = None  # when the version's files were completed (index time)


@dataclass(frozen=True)
class Activation:
    """One completed activation on a replica (the acknowledgement's record)."""

    version: int
    published_unix: float | None
    activated_unix: float
    prepare_s: float  # staging (fetch + verify + load into RAM) while serving, all coalesced rounds
    pause_s: float  # the engine could not admit or advance generation
    num_restages: int = 0  # newer versions seen while staging, staged straight away (coalescing)


@dataclass(frozen=True)
class Deregistration:
    """``POST {gateway}/deregister``: a replica leaves the fleet."""

    replica_id: str


@dataclass
class ReplicaStatus:
    """One heartbeat (see the module docstring)."""

    replica_id: str
    incarnation: str
    seq: int
    engine_url: str | None
    control_url: str | None
    state: ReplicaState
    weight_version: int | None = None  # the live, acknowledged version (routing uses it only when ready)
    run_id: str = ""
    staged_version: int | None = None
    store_head: StoreHead | None = None
    last_error: str | None = None
    load: int | None = None  # requests running or queued in the engine, when it says
    activations: list[Activation] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    lora_base_dir: str | None = None  # the adapter chain (its version 0) the engine serves versions of; None: full weights

    def __post_init__(self) -> None:
        for name in ("replica_id", "incarnation"):
            if not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string")

    def to_json(self) -> dict[str, Any]:
        obj = asdict(self)
        obj["state"] = self.state.value
        return obj

    @classmethod
    def from_json(cls, body: bytes | Any) -> "ReplicaStatus":
        """Validate a heartbeat (raw bytes or decoded JSON) strictly; ``InvalidInput`` naming the field."""
        from miles_disagg.net.httpjson import parse_body

        return parse_body(cls, body)
