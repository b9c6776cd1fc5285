"""Blockwise-FP8 linear layers for the native models: the weight is stored as ``float8_e4m3fn`` with its
``weight_scale_inv`` beside it (both parameters under the checkpoint's names, so a weight update swaps
them by name like any other tensor) and dequantized block by block at each forward pass.

The computation is exactly that of a full-precision linear layer whose weight is
:func:`miles_disagg.models.fp8.dequantize` of the stored pair, in the model's compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles_disagg.models.fp8 import BlockFp8, dequantize, scale_shape


class Fp8Linear(nn.Module):
    """A bias-free linear layer over a blockwise-FP8 weight (inference only: no gradients)."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], compute_dtype: torch.dtype):
        super().__init__()
        self.block = block
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(scale_shape((out_features, in_features), block), dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight, self.weight_scale_inv, self.block, self.compute_dtype))


def use_fp8_linears(model: nn.Module, fp8_weight_names: set[str], scheme: BlockFp8,
                    compute_dtype: torch.dtype) -> None:
    """Replace each linear layer whose ``<module>.weight`` is in ``fp8_weight_names`` with an
    uninitialised :class:`Fp8Linear` of the same shape (the checkpoint's tensors are loaded after)."""
    for module_name, module in list(model.named_modules()):
        if f"{module_name}.weight" not in fp8_weight_names:
            continue
        out_features, in_features = module.weight.shape
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear(in_features, out_features, scheme.block, compute_dtype))
