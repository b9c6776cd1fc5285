"""Between torch tensors and raw little-endian bytes (torch is imported only here, lazily)."""

from __future__ import annotations

from typing import Any

import numpy as np

from miles_disagg.types import LayoutMismatch

_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
}


def dtype_code(dtype: Any) -> str:
    """The safetensors dtype code of a torch dtype (``BF16``, ``F32``, ...)."""
    name = str(dtype).removeprefix("torch.")
    try:
        return _CODES[name]
    except KeyError:
        raise LayoutMismatch(f"disk-delta does not support tensor dtype {dtype}") from None


def dtype_from_code(code: str) -> Any:
    import torch

    for name, value in _CODES.items():
        if value == code and hasattr(torch, name):
            return getattr(torch, name)
    raise LayoutMismatch(f"no torch dtype for safetensors dtype {code}")


def tensor_bytes(tensor: Any) -> np.ndarray:
    """A uint8 numpy view of a tensor's bytes (copied to CPU/contiguous only when needed)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    import torch

    return t.view(torch.uint8).reshape(-1).numpy()


def bytes_to_tensor(buf: np.ndarray, dtype: Any, shape: tuple[int, ...]) -> Any:
    import torch

    return torch.from_numpy(buf).view(dtype).reshape(shape)
