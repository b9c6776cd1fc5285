"""Joining the trainer ranks' process group: the one place both backends (fsdp, megatron) start it."""

from __future__ import annotations


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

