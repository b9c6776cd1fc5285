"""transformers 5's fused in-memory expert tensors -> the per-expert names a checkpoint holds.

A Qwen3-MoE checkpoint on disk names every expert's matrices
(``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``); transformers 5 keeps them fused
in memory as ``mlp.experts.gate_up_proj`` ``[experts, 2 * moe_intermediate, hidden]`` (gate rows
first, then up) and ``mlp.experts.down_proj`` ``[experts, hidden, moe_intermediate]``, and
converts on load and save. Versions are published in the on-disk names (what SGLang and
``from_pretrained`` read), so anything that takes tensors from a transformers module passes them
through :func:`on_disk_tensors` first. Other tensors pass unchanged; the native model
(:mod:`miles_disagg.models.qwen3_moe`) already uses the on-disk names.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

FUSED_GATE_UP = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.gate_up_proj$")
FUSED_DOWN = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.down_proj$")


def on_disk_tensors(named: Iterable[tuple[str, "torch.Tensor"]]) -> Iterator[tuple[str, "torch.Tensor"]]:  # noqa: F821
    """Each fused expert tensor split into one 2-D tensor per expert under its on-disk name;
    anything else as given. Splits are copies: they share no storage (safetensors refuses shared
    tensors, and the fused source may be freed or changed)."""
    for name, tensor in named:
        gate_up, down = FUSED_GATE_UP.match(name), FUSED_DOWN.match(name)
        if gate_up and tensor.dim() == 3:
            width = tensor.shape[1] // 2
            for expert in range(tensor.shape[0]):
                prefix = f"{gate_up['prefix']}.{expert}"
                yield f"{prefix}.gate_proj.weight", tensor[expert, :width].clone()
                yield f"{prefix}.up_proj.weight", tensor[expert, width:].clone()
        elif down and tensor.dim() == 3:
            for expert in range(tensor.shape[0]):
                yield f"{down['prefix']}.{expert}.down_proj.weight", tensor[expert].clone()
        else:
            yield name, tensor


def has_fused_experts(names: Iterable[str]) -> bool:
    """Whether a state dict holds transformers' fused expert tensors."""
    return any(FUSED_GATE_UP.match(n) or FUSED_DOWN.match(n) for n in names)
