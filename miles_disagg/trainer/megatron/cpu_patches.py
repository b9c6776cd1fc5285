"""Let megatron-core run on CPU (gloo) where CUDA is absent: tests and laptops only.

megatron-core assumes a CUDA device in four places that a CPU run reaches:

- ``torch.cuda.current_device()`` names the device of every buffer it allocates
  (all-gathers, sequence-parallel scatters, rotary tables); on CPU it answers ``"cpu"``.
- the CUDA RNG tracker's ``fork()`` swaps CUDA generator states around dropout and
  initialization; on CPU it is a no-op context (the CPU generator is untouched, so
  dropout still draws from it).
- activation recomputation saves and restores the CUDA generator state; on CPU those
  two helpers do nothing (the CPU state is still saved and restored by megatron).
- distributed checkpointing's writer waits for device-to-host copies with
  ``torch.cuda.synchronize()``; on CPU there are none to wait for, so it returns at once.

MoE layers add three more:

- the router's gating GEMM names ``te_general_gemm``, which megatron's ``moe_utils`` only
  defines when Transformer Engine imports; without it the name is set to None, megatron's
  own sign for "use ``torch.mm``".
- the all-to-all token dispatcher creates a CUDA stream (for device-to-host copies of its
  split sizes) when it is first built; on CPU a placeholder stands in, never used.
- that dispatcher's device-to-host step turns the split sizes into numpy arrays on a side
  stream; on CPU the sizes are already on the host, so they only become the numpy arrays
  ``all_to_all_single`` takes (gloo runs the all-to-all itself).

Nothing else is needed: the model must be built with ``use_cpu_initialization=True``
and called with an explicit causal mask (megatron's default mask is made on "cuda").
``apply_cpu_patches`` changes nothing when CUDA is available, and is idempotent.
The patches are process-wide: a process that applied them runs megatron on CPU only.

``fusions_left_uncompiled`` is for the import itself: megatron wraps its fused activations
in ``torch.compile`` as its modules load, which imports TorchDynamo and Inductor (about 3
CPU-seconds in every trainer rank) for kernels a CPU run never compiles. Without CUDA the
import sees a ``torch.compile`` that returns the function as it is, which is megatron's
own ``disable_jit_fuser`` applied before its modules load.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

_applied = False


def apply_cpu_patches() -> bool:
    """Patch megatron-core for CPU when CUDA is absent; returns whether patches are in effect."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = _nothing_to_synchronize
    megatron_random.CudaRNGStatesTracker.fork = _no_fork
    megatron_random._get_cuda_rng_state = _no_cuda_rng_state
    megatron_random._set_cuda_rng_state = _ignore_cuda_rng_state
    _patch_moe()
    _applied = True
    return True


def _patch_moe() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    if dispatcher.cuda_dtoh_stream is None:
        dispatcher.cuda_dtoh_stream = _NoStream()
    dispatcher._maybe_dtoh_and_synchronize = _host_splits


class _NoStream:
    """Stands in for the dispatcher's device-to-host CUDA stream on CPU (never used)."""


_SPLIT_SIZES = ("input_splits", "output_splits", "output_splits_tp")


def _host_splits(self, point: str, tokens_per_expert=None):
    """The all-to-all dispatcher's device-to-host step on CPU: at its copy point, the split
    sizes become numpy arrays (the form ``all_to_all_single`` takes); nothing to synchronize."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in _SPLIT_SIZES:
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _cpu_device() -> str:
    return "cpu"


def _nothing_to_synchronize(device=None) -> None:
    return None


def _no_fork(self, name: str = "model-parallel-rng"):
    return contextlib.nullcontext()


def _no_cuda_rng_state(*args, **kwargs) -> None:
    return None


def _ignore_cuda_rng_state(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def fusions_left_uncompiled() -> Iterator[None]:
    """While megatron-core is first imported on a machine without CUDA, ``torch.compile`` is
    the identity (its fused activations stay plain functions); elsewhere this does nothing."""
    if torch.cuda.is_available() or "megatron.core" in sys.modules:
        yield
        return
    real_compile = torch.compile
    torch.compile = _uncompiled
    try:
        yield
        jit = sys.modules.get("megatron.core.jit")
        if jit is not None:
            jit.disable_jit_fuser()
    finally:
        torch.compile = real_compile


def _uncompiled(model=None, **options):
    return model if model is not None else _return_as_is


def _return_as_is(function):
    return function
