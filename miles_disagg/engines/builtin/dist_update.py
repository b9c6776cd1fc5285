"""SGLang's broadcast weight path: a torch.distributed group with the trainer.

``/init_weights_update_group`` forms a process group *separate from any default group*,
the same way SGLang does: a TCP rendezvous at ``tcp://master_address:master_port``, the
store prefixed by ``group_name``, trainer rank 0 and this engine at ``rank_offset``
(one engine rank: no tensor parallelism here). ``/update_weights_from_distributed``
receives each named tensor by ``broadcast(src=0)`` into fresh buffers off the scheduler
thread; only the pointer swap happens in the pause.

Backend: the requested one, except that ``nccl`` on a CPU engine is served with
``gloo`` (the trainer side must then use gloo too, as this project's CPU trainer does).
The group is made by :func:`miles_disagg.distributed.init_custom_process_group`, which
the trainer's rank 0 (and the tests) use to join the same group.
"""

from __future__ import annotations

import threading

import torch

from miles_disagg.distributed import DEFAULT_TIMEOUT_S, init_custom_process_group
from miles_disagg.engines.builtin.control_bodies import DistributedUpdate, InitGroup
from miles_disagg.types import InvalidInput

def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidInput(f"unknown dtype {name!r}")
    return dtype


class DistUpdater:
    """Named weight-update groups of this engine and the receive side of a broadcast."""

    def __init__(self, device: torch.device):
        self.device = device
        self.groups: dict[str, object] = {}
        self._lock = threading.Lock()

    def backend_for(self, requested: str) -> str:
        if requested == "nccl" and self.device.type != "cuda":
            return "gloo"
        return requested

    def init_group(self, req: InitGroup, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
        """Join the trainer's group (blocks until every rank has joined)."""
        backend = self.backend_for(req.backend)
        with self._lock:
            if req.group_name in self.groups:
                raise InvalidInput(f"weight update group {req.group_name!r} already exists")
            try:
                self.groups[req.group_name] = init_custom_process_group(
                    backend=backend, init_method=f"tcp://{req.master_address}:{req.master_port}",
                    world_size=req.world_size, rank=req.rank_offset, group_name=req.group_name, timeout_s=timeout_s,
                )
            except (RuntimeError, ValueError, OSError) as exc:  # the rendezvous the caller named failed
                raise InvalidInput(f"could not join weight update group {req.group_name!r} at "
                                   f"{req.master_address}:{req.master_port}: {type(exc).__name__}: {exc}") from exc
        return backend

    def destroy_group(self, group_name: str) -> None:
        """``/destroy_weights_update_group``: leave and forget the group (400 if there is none)."""
        import torch.distributed as dist

        with self._lock:
            group = self.groups.pop(group_name, None)
        if group is None:
            raise InvalidInput(f"no weight update group named {group_name!r}")
        dist.destroy_process_group(group)

    def receive(self, req: DistributedUpdate, live_params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Receive every tensor of ``req`` from rank 0, converted to the live dtype.

        Layout is checked before the first receive so a bad request fails without
        desynchronizing the group; the trainer must not broadcast after a 4xx answer.
        """
        import torch.distributed as dist

        group = self.groups.get(req.group_name)
        if group is None:
            raise InvalidInput(f"no weight update group named {req.group_name!r}; call /init_weights_update_group first")
        dtypes = [parse_dtype(d) for d in req.dtypes]
        for name, shape in zip(req.names, req.shapes):
            live = live_params.get(name)
            if live is None:
                raise InvalidInput(f"{name!r} is not a parameter of the live model")
            if tuple(live.shape) != tuple(shape):
                raise InvalidInput(f"{name!r} has shape {tuple(shape)}, the live model {tuple(live.shape)}")
        received: dict[str, torch.Tensor] = {}
        comm_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        for name, dtype, shape in zip(req.names, dtypes, req.shapes):
            buffer = torch.empty(tuple(shape), dtype=dtype, device=comm_device)
            dist.broadcast(buffer, src=0, group=group)
            received[name] = buffer.to(device=self.device, dtype=live_params[name].dtype)
        return received
