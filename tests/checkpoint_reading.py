"""Reading a training save's ``state/`` offline, as tests check it (no process group needed)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch


def read_state(save_dir: Path) -> dict:
    """``save_dir/state`` (a torch.distributed.checkpoint directory, as the fsdp backend and
    megatron-core's torch_dist format write it) as full tensors, nested as saved: fsdp
    ``{"model": {fqn: ...}, "optimizer": {"state.<fqn>.<moment>": ...}}``, megatron
    ``{sharded key: ...}`` (the moments under ``optimizer.state.<moment>.<key>``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    full = Path(tempfile.mkdtemp(prefix="state")) / "state.pt"  # never beside the saves: find_latest reads iter_*
    dcp_to_torch_save(Path(save_dir) / "state", full)
    return torch.load(full, weights_only=False)


def assert_same_state(a, b, where: str = "") -> None:
    """Equal structure, equal values; tensors equal to the bit, in the same dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for key in a:
            assert_same_state(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{index}]")
    else:
        assert a == b, where
