"""What a trainer save holds besides the sharded model and optimizer: each rank's RNG state.

A save directory (see ``trainer/checkpoint.py``) holds::

    state/            model and optimizer in a layout that does not depend on the number of
                      ranks (fsdp: torch.distributed.checkpoint; megatron: megatron-core's
                      dist_checkpointing, itself written through torch.distributed.checkpoint)
    rng/rank0.pt ...  each rank's CPU generator state (``torch.get_rng_state()``)

RNG states are per rank and cannot be resharded. On load, rank ``r`` restores
``rng/rank{r}.pt`` when the save has it; a rank the saving run did not have (the run grew)
is reseeded with ``--seed + r``, the seed a fresh run gives that rank, so a resumed run is
deterministic whatever the rank count. States of ranks the resumed run no longer has (the
run shrank) are left unused.
"""

from __future__ import annotations

import os

STATE_DIR = "state"
RNG_DIR = "rng"


def state_dir(directory: str) -> str:
    return os.path.join(directory, STATE_DIR)


def save_rng(directory: str, rank: int) -> None:
    """``directory/rng/rank{rank}.pt``: this process's CPU generator state."""
    import torch

    os.makedirs(os.path.join(directory, RNG_DIR), exist_ok=True)
    torch.save(torch.get_rng_state(), _rng_path(directory, rank))


def load_rng(directory: str, rank: int, seed: int) -> bool:
    """Restore this rank's saved generator state; without one, reseed with ``seed + rank``.
    Returns whether a saved state was restored."""
    import torch

    path = _rng_path(directory, rank)
    if os.path.isfile(path):
        torch.set_rng_state(torch.load(path, weights_only=True))
        return True
    torch.manual_seed(seed + rank)
    return False


def _rng_path(directory: str, rank: int) -> str:
    return os.path.join(directory, RNG_DIR, f"rank{rank}.pt")
