"""Trainer memory handoff for ``--colocate``: parameters, gradients and optimizer state leave
the device while the engines generate, and come back to train.

* CUDA: the module moves to host memory with ``module.to("cpu")`` (FSDP2 moves its sharded
  DTensor parameters itself), the optimizer state tensors with ``.to("cpu")``, and the caching
  allocator is emptied, so the GPU is the engines' while they generate.
* CPU (no accelerator): the trainer already lives in host memory, so "off the device" means
  out of the process: each tensor is written to a spill file (``/dev/shm`` by default, still
  RAM but not the process's) and its storage freed (``malloc_trim`` returns the heap), so the
  process's RSS drops by what it offloaded. Onload reads the file back.

Gradients are dropped, not moved: after the optimizer step they are spent, and the next step
sets them anew (``zero_grad(set_to_none=True)``). Contract: offload calls may come in parts
(the optimizer state first, the parameters after the weights were handed to the engines),
nothing touches what is offloaded, and one onload restores every tensor bit for bit.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch

from miles_disagg.engines.builtin.memory import give_memory_back

DEFAULT_SPILL_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


@dataclass
class _Slot:
    """Where one spilled tensor lived (CPU) and where its bytes are in the spill file."""

    owner: object  # a Parameter (its .data) or an optimizer state dict
    key: str | None  # None: the parameter itself; else the state dict's key
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0
    nbytes: int = 0


class HostOffloader:
    """Moves a module's parameters and an optimizer's state off the device and back."""

    def __init__(self, device: torch.device, spill_dir: str | None = DEFAULT_SPILL_DIR):
        self.device = device
        self.spill_dir = spill_dir
        self._slots: list[_Slot] = []
        self._moved_module: torch.nn.Module | None = None
        self._moved_states: list[dict] = []
        self._spill = None
        self.offloaded = False

    def offload(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                *, params: bool = True) -> dict[str, int]:
        """Offload the optimizer's state (None: not now) and the parameters (unless ``params=False``);
        drop the gradients. Returns the bytes offloaded by kind."""
        if params and (self._moved_module is not None or any(s.key is None for s in self._slots)):
            raise RuntimeError("the parameters are offloaded already: onload first")
        sizes = {"params": 0, "optimizer": 0, "grads": 0}
        for param in module.parameters():
            if param.grad is not None:
                sizes["grads"] += _nbytes(param.grad)
                param.grad = None
        states = list(optimizer.state.values()) if optimizer is not None else []
        if params:
            sizes["params"] = sum(_nbytes(p) for p in module.parameters())
        sizes["optimizer"] = sum(_nbytes(v) for st in states for v in st.values() if _offloadable(v))
        if self.device.type == "cuda":
            self._to_host(module if params else None, states)
        else:
            self._spill_out(module if params else None, states)
        self.offloaded = True
        give_memory_back(self.device)
        return sizes

    def onload(self) -> None:
        """Every offloaded tensor back where it was, bit for bit."""
        if not self.offloaded:
            return
        if self.device.type == "cuda":
            if self._moved_module is not None:
                self._moved_module.to(self.device)
            for state in self._moved_states:
                for key, value in state.items():
                    if _offloadable(value):
                        state[key] = value.to(self.device)
        else:
            for slot in self._slots:
                _set(slot, self._read(slot))
            self._spill.close() if self._spill is not None else None
            self._spill, self._slots = None, []
        self._moved_module, self._moved_states, self.offloaded = None, [], False

    # ------------------------------------------------------------------ CUDA: host memory

    def _to_host(self, module: torch.nn.Module | None, states: list[dict]) -> None:
        if module is not None:
            module.to("cpu")
        for state in states:
            for key, value in state.items():
                if _offloadable(value):
                    state[key] = value.to("cpu")
        self._moved_module = module or self._moved_module
        self._moved_states += states

    # ------------------------------------------------------------------ CPU: out of the process

    def _spill_out(self, module: torch.nn.Module | None, states: list[dict]) -> None:
        slots = [_Slot(p, None, tuple(p.shape), p.dtype) for p in module.parameters()] if module is not None else []
        slots += [_Slot(state, key, tuple(value.shape), value.dtype)
                  for state in states for key, value in state.items() if _offloadable(value)]
        for slot in slots:
            tensor = slot.owner.data if slot.key is None else slot.owner[slot.key]
            spill = self._spill_file()
            slot.offset, slot.nbytes = spill.seek(0, os.SEEK_END), _nbytes(tensor)
            spill.write(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
            _set(slot, torch.empty(0, dtype=slot.dtype))
        self._slots += slots

    def _read(self, slot: _Slot) -> torch.Tensor:
        if slot.nbytes == 0:
            return torch.empty(slot.shape, dtype=slot.dtype)
        self._spill.seek(slot.offset)
        raw = bytearray(self._spill.read(slot.nbytes))
        return torch.frombuffer(raw, dtype=torch.uint8).view(slot.dtype).reshape(slot.shape).clone()

    def _spill_file(self):
        if self._spill is None:
            self._spill = tempfile.TemporaryFile(dir=self.spill_dir, prefix="miles-disagg-offload-")
        return self._spill


def _set(slot: _Slot, tensor: torch.Tensor) -> None:
    if slot.key is None:
        slot.owner.data = tensor
    else:
        slot.owner[slot.key] = tensor


def _offloadable(value: object) -> bool:
    """Optimizer state tensors worth moving (not the scalar ``step``)."""
    return isinstance(value, torch.Tensor) and value.numel() > 1


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
