"""miles' ``--reset-optimizer-states``: the optimizer's history cleared after each rollout's training."""

from __future__ import annotations

import torch

MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
"""Adam's history; other state entries (an optimizer's own master weights) are never touched."""
OPTIMIZER_ATTRIBUTES = ("optimizer", "optim")
"""Where a backend, or an optimizer wrapper (ours, megatron's), holds the optimizer it drives."""


def torch_optimizers(holder, depth: int = 4) -> list[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` objects reachable from ``holder`` through its public optimizer
    attributes (and megatron's ``chained_optimizers``), each once."""
    found: list[torch.optim.Optimizer] = []
    if isinstance(holder, torch.optim.Optimizer):
        return [holder]
    if depth == 0 or holder is None:
        return found
    children = [getattr(holder, name, None) for name in OPTIMIZER_ATTRIBUTES]
    children += list(getattr(holder, "chained_optimizers", None) or [])
    for child in children:
        for optimizer in torch_optimizers(child, depth - 1):
            if all(optimizer is not seen for seen in found):
                found.append(optimizer)
    return found


@torch.no_grad()
def reset_optimizer_states(holder) -> int:
    """Zero Adam's moments and step counts in place, as a fresh
    optimizer has them: the next step starts Adam's bias correction over. In place, so sharded
    (FSDP DTensor, megatron distributed-optimizer) state keeps its layout, and saves stay loadable.
    Returns the number of parameters whose state was reset."""
    count = 0
    for optimizer in torch_optimizers(holder):
        for state in optimizer.state.values():
            for key, value in state.items():
                if key in MOMENT_KEYS or (key == "step" and torch.is_tensor(value)):
                    value.zero_()
                elif key == "step":
                    state[key] = 0
            count += 1
        for group in optimizer.param_groups:
            if "step" in group:
                group["step"] = 0
    if count == 0 and not torch_optimizers(holder):
        raise ValueError(f"--reset-optimizer-states: no optimizer found on {type(holder).__name__}")
    return count
