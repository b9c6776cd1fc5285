"""Named tensors by reference between processes on one host: SGLang's ``/update_weights_from_tensor``.

The wire format is SGLang's (``UpdateWeightsFromTensorReqInput.serialized_named_tensors``): one
entry per tensor-parallel rank, each the base64 of a ``multiprocessing`` ``ForkingPickler``
dump of a list of ``(name, tensor)`` pairs (``load_format`` None). The pickle carries no tensor
bytes, only handles: a CUDA tensor travels as a CUDA IPC handle, a CPU tensor as the name of a
shared-memory segment (``torch.multiprocessing``'s ``file_system`` strategy, which a process
that is not our child can open; the default ``file_descriptor`` strategy cannot cross to an
unrelated process). The sender must keep the tensors alive until the receiver has copied
them (the HTTP answer).

The receiving side unpickles with an allow-list (containers, torch's own rebuild functions,
dtypes, ``torch.Size``): a payload naming any other global is refused (``InvalidInput``), so
the endpoint never runs arbitrary pickled code. Opening a named shared-memory segment is
still a host-local privilege: the endpoint is an admin one.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Iterable

from miles_disagg.types import InvalidInput

_ALLOWED_GLOBALS = {
    ("builtins", "list"), ("builtins", "tuple"), ("builtins", "dict"), ("collections", "OrderedDict"),
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
}


def serialize_named_tensors(named_tensors: Iterable[tuple[str, object]]) -> str:
    """One rank's entry of ``serialized_named_tensors``: handles to the tensors, base64."""
    import torch.multiprocessing
    from multiprocessing.reduction import ForkingPickler

    torch.multiprocessing.set_sharing_strategy("file_system")  # openable by a process that is not our child
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([(str(name), tensor) for name, tensor in named_tensors])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise InvalidInput(f"serialized_named_tensors names {module}.{name}, which is not a tensor handle")


def deserialize_named_tensors(payload: str | bytes) -> list[tuple[str, object]]:
    """The ``(name, tensor)`` pairs of one entry; ``InvalidInput`` for anything else."""
    import torch

    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise InvalidInput(f"serialized_named_tensors is not base64: {exc}") from exc
    try:
        value = _TensorUnpickler(io.BytesIO(raw)).load()
    except InvalidInput:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated payload or a handle that cannot be opened
        raise InvalidInput(f"serialized_named_tensors cannot be opened: {type(exc).__name__}: {exc}") from exc
    if not isinstance(value, list) or not all(
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
            for item in value):
        raise InvalidInput("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return value
