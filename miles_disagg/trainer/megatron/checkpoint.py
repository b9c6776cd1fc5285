"""The megatron backend's training checkpoint: megatron-core's distributed checkpointing.

``directory/state`` is a ``dist_checkpointing`` checkpoint (the ``torch_dist`` format,
written through ``torch.distributed.checkpoint``): the model's sharded state dict (every
parameter as a global tensor, each rank writing the shards it owns, TP-duplicated and
DP-replicated ones once) and the optimizer's (see ``optim.py``: on CPU the moments of the
plain AdamW share their parameter's sharding; on GPU the distributed optimizer's
``fully_reshardable`` state). A save therefore loads under another TP or DP layout of the
same model (the CPU path is tested TP 1 <-> 2; keys are global, so pipeline stages reshard
the same way in megatron-core). ``directory/rng`` holds each rank's generator state
(``trainer/rank_state.py``). Both functions are collective over all trainer ranks.
"""

from __future__ import annotations

import os

import torch

from miles_disagg.trainer.rank_state import load_rng, save_rng, state_dir
from miles_disagg.trainer.torch_dist import results_in_this_process


def save_checkpoint(gpt: torch.nn.Module, optim, directory: str, rank: int) -> None:
    from megatron.core import dist_checkpointing

    path = state_dir(directory)
    os.makedirs(path, exist_ok=True)
    with results_in_this_process():
        dist_checkpointing.save(_sharded_state(gpt, optim, is_loading=False), path)
    save_rng(directory, rank)


def load_checkpoint(gpt: torch.nn.Module, optim, directory: str, rank: int, seed: int) -> None:
    """Load the parts of every tensor this rank holds, whatever layout wrote them; the model
    must match in every parameter (``load_state_dict`` is strict)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded_state(gpt, optim, is_loading=True), state_dir(directory))
    gpt.load_state_dict(loaded["model"])
    optim.load_sharded_state_dict(loaded["optimizer"])
    load_rng(directory, rank, seed)


def _sharded_state(gpt: torch.nn.Module, optim, is_loading: bool) -> dict:
    model = gpt.sharded_state_dict()
    return {"model": model, "optimizer": optim.sharded_state_dict(model, is_loading)}
