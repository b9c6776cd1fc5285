"""torch.distributed process groups: the trainer ranks' default group (both backends, fsdp and
megatron, start it here) and the separate weight-update group that trainer rank 0 and the
engines form in broadcast mode (SGLang's ``/init_weights_update_group`` contract)."""

from __future__ import annotations

import datetime

DEFAULT_TIMEOUT_S = 300.0


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> str:
    """Join the trainer's process group (nccl on GPU, gloo on CPU); returns the backend."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this rank's GPU
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size)
    return backend


def init_custom_process_group(
    *, backend: str, init_method: str, world_size: int, rank: int, group_name: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
):
    """A process group of its own (the default group is neither needed nor touched)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefix_store = dist.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), prefix_store, group_name=group_name, timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
