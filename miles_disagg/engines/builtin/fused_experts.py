"""The engine's weights under their checkpoint (on-disk) names when the model fuses its experts.

transformers 5 keeps a Qwen3-MoE's experts as two 3-D parameters per layer
(``mlp.experts.gate_up_proj`` ``[experts, 2 * width, hidden]``, gate rows first, and
``mlp.experts.down_proj`` ``[experts, hidden, width]``), while checkpoints, published versions,
``/weight_checksums`` and every weight-update endpoint name one 2-D matrix per expert
(``mlp.experts.E.{gate,up,down}_proj.weight``). :class:`ExpertLayout` maps between the two for the
model runner (the native model already has the on-disk names: its layout is empty):

* :meth:`named_weights`: on-disk name -> tensor (a parameter, or a view into a fused one);
* :meth:`swap_in`: new tensors by on-disk name made live. A fused parameter is rebuilt as a new
  tensor (the live one copied, the given experts written) and then swapped in by pointer, so the
  live weights are never written into and every fused parameter is built before any swap. The
  tensors it displaces are returned, so the caller frees them where it chooses (not in the pause).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch

from miles_disagg.models.moe_names import FUSED_DOWN, FUSED_GATE_UP


@dataclass(frozen=True)
class ExpertSlice:
    fused: str  # the fused parameter's name
    expert: int
    rows: slice  # rows of that expert's matrix in the fused parameter
    shape: tuple[int, ...]
    dtype: torch.dtype


class ExpertLayout:
    """On-disk expert names of a model's fused expert parameters (none: an empty layout)."""

    def __init__(self, params: dict[str, torch.nn.Parameter]):
        self.slices: dict[str, ExpertSlice] = {}
        for name, param in params.items():
            gate_up, down = FUSED_GATE_UP.match(name), FUSED_DOWN.match(name)
            if gate_up and param.dim() == 3:
                width = param.shape[1] // 2
                for e in range(param.shape[0]):
                    for part, rows in (("gate_proj", slice(0, width)), ("up_proj", slice(width, 2 * width))):
                        self._add(f"{gate_up['prefix']}.{e}.{part}.weight", name, e, rows, param)
            elif down and param.dim() == 3:
                for e in range(param.shape[0]):
                    self._add(f"{down['prefix']}.{e}.down_proj.weight", name, e, slice(None), param)
        self.fused = {s.fused for s in self.slices.values()}

    def _add(self, name: str, fused: str, expert: int, rows: slice, param: torch.Tensor) -> None:
        shape = tuple(param[expert, rows].shape)
        self.slices[name] = ExpertSlice(fused, expert, rows, shape, param.dtype)

    def named_weights(self, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        """Every weight by its on-disk name; experts are views into the live fused parameters (meta
        tensors of the right shape while the weights are released)."""
        out: dict[str, torch.Tensor] = {n: p for n, p in params.items() if n not in self.fused}
        for name, s in self.slices.items():
            data = params[s.fused].data
            out[name] = data[s.expert, s.rows] if data.numel() else torch.empty(s.shape, dtype=s.dtype, device="meta")
        return out

    def swap_in(self, params: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Make ``tensors`` (by on-disk name) live; returns the tensors they displaced (see the module docstring)."""
        parts: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        plain = {}
        for name, tensor in tensors.items():
            if name in self.slices:
                parts[self.slices[name].fused][name] = tensor
            else:
                plain[name] = tensor
        rebuilt = {fused: self._rebuilt(params[fused].data, given) for fused, given in parts.items()}
        displaced = []
        for name, tensor in {**plain, **rebuilt}.items():
            displaced.append(params[name].data)
            params[name].data = tensor
        return displaced

    def _rebuilt(self, live: torch.Tensor, given: dict[str, torch.Tensor]) -> torch.Tensor:
        new = live.clone()
        for name, tensor in given.items():
            s = self.slices[name]
            new[s.expert, s.rows] = tensor
        return new

    def live_names(self, names: Iterable[str]) -> set[str]:
        """The live parameters ``names`` give real values in full (a fused one: all of its experts)."""
        names = set(names)
        covered: dict[str, int] = defaultdict(int)
        for name in names & set(self.slices):
            covered[self.slices[name].fused] += 1
        totals: dict[str, int] = defaultdict(int)
        for s in self.slices.values():
            totals[s.fused] += 1
        return (names - set(self.slices)) | {f for f, n in covered.items() if n == totals[f]}
