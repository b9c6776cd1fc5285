"""Megatron ``torch_dist`` checkpoints (what miles passes as ``--ref-load`` and ``--load``).

A miles run names its weights twice: ``--hf-checkpoint`` (architecture, tokenizer, the engines'
base) and a Megatron distributed checkpoint (``Qwen3-4B_torch_dist``: ``latest_checkpointed_iteration.txt``
naming ``release`` or an iteration, whose directory holds ``metadata.json`` with
``"sharded_backend": "torch_dist"``, ``common.pt`` and ``*.distcp`` shards). Here the megatron
backend builds its ``GPTModel`` from the HF config and then reads such a checkpoint into it with
megatron-core's ``dist_checkpointing`` (any TP/PP layout reshards on load), on CPU too.

Only model weights are read (``_extra_state`` objects and anything else the checkpoint holds,
e.g. optimizer state, are left alone). Norm weights that Transformer Engine layers fuse into the
following linear layer (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) are
matched to megatron's local layers (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``)
and back, so a checkpoint written on GPU loads into a CPU model. A tensor the model needs and
the checkpoint lacks is a ``ConfigError`` naming the flag: never a partial load.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from miles_disagg.types import ConfigError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"

# megatron local layer name <-> Transformer Engine fused name (per layer; keys carry no layer index)
_NORM_ALIASES = (("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
                 ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"))


def torch_dist_dir(path: str | Path | None) -> Path | None:
    """The iteration directory of a Megatron ``torch_dist`` checkpoint at ``path`` (the run
    directory with its tracker file, or the iteration directory itself); None when ``path`` is
    not one (an HF directory, a save of this project, nothing)."""
    if not path:
        return None
    root = Path(path)
    tracker = root / TRACKER_FILE
    if tracker.is_file():
        iteration = tracker.read_text().strip()
        root = root / (iteration if iteration == "release" else f"iter_{int(iteration):07d}")
    metadata = root / METADATA_FILE
    if not metadata.is_file():
        return None
    try:
        backend = json.loads(metadata.read_text()).get("sharded_backend")
    except (ValueError, AttributeError):
        return None
    return root if backend == "torch_dist" else None


def load_torch_dist(model: Any, path: str | Path, flag: str) -> None:
    """Read the weights of the ``torch_dist`` checkpoint at ``path`` into ``model`` (a megatron
    ``GPTModel`` stage, all ranks at once: collective). ``ConfigError`` naming ``flag`` when the
    checkpoint lacks a tensor the model has, or a shape differs."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    directory = torch_dist_dir(path)
    if directory is None:
        raise ConfigError(f"{flag} {str(path)!r} is not a Megatron torch_dist checkpoint", (flag,))
    available = _checkpoint_keys(directory)
    request = _weights_request(model, available)
    missing = sorted(sh.key for sh in request.values() if sh.key not in available)
    if missing:
        raise ConfigError(f"{flag} {path}: the checkpoint has no {', '.join(missing[:4])}"
                          f"{' ...' if len(missing) > 4 else ''} (is it a checkpoint of this model?)", (flag,))
    try:
        loaded = dist_checkpointing.load(request, str(directory), strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    except (RuntimeError, ValueError, KeyError, AssertionError) as exc:
        raise ConfigError(f"{flag} {path}: cannot read the checkpoint into the model ({type(exc).__name__}: {exc})",
                          (flag,)) from None
    result = model.load_state_dict(loaded, strict=False)
    absent = [name for name in result.missing_keys if not name.endswith("_extra_state")]
    if absent:
        raise ConfigError(f"{flag} {path}: no weights for {', '.join(absent[:4])}", (flag,))


def save_torch_dist(model: Any, path: str | Path, iteration: str = "release") -> Path:
    """Write ``model``'s weights as a Megatron ``torch_dist`` checkpoint (tracker file and
    iteration directory), as Megatron-LM lays one out; collective. Returns the iteration dir."""
    from megatron.core import dist_checkpointing

    root = Path(path)
    directory = root / (iteration if iteration == "release" else f"iter_{int(iteration):07d}")
    directory.mkdir(parents=True, exist_ok=True)
    with _cpu_save(), results_in_this_process():
        dist_checkpointing.save(model.sharded_state_dict(), str(directory))
    (root / TRACKER_FILE).write_text(iteration)
    return directory


def _checkpoint_keys(directory: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


def _weights_request(model: Any, available: set[str]) -> dict[str, Any]:
    """The model's sharded tensors (no ``_extra_state`` objects), each under the name the
    checkpoint uses for it (local <-> Transformer Engine norm names)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    request = {}
    for name, sharded in model.sharded_state_dict().items():
        if not isinstance(sharded, (ShardedTensor, ShardedTensorFactory)):  # e.g. SwiGLU's fused fc1 is a factory
            continue
        if sharded.key not in available:
            for fused, local in _NORM_ALIASES:
                for ours, theirs in ((local, fused), (fused, local)):
                    if sharded.key.endswith(ours) and sharded.key[:-len(ours)] + theirs in available:
                        sharded.key = sharded.key[:-len(ours)] + theirs
        request[name] = sharded
    return request


@contextlib.contextmanager
def _cpu_save():
    """megatron's writer calls ``torch.cuda.synchronize()`` after its (no-op on CPU) copies; on a
    machine without CUDA that call is the only obstacle, so it is a no-op while saving."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.synchronize = original


@contextlib.contextmanager
def results_in_this_process():
    """A synchronous ``dist_checkpointing.save`` without a spawned helper process.

    megatron's torch_dist writer passes each save's write results through a queue it keeps in a
    ``multiprocessing`` Manager made with the spawn method: a fresh interpreter that imports torch
    (about 1.5 CPU-seconds, once in every process that saves). That queue exists for megatron's
    asynchronous saves, whose writing runs in another process; in a synchronous save the results are
    put and read back by this process, so a queue of this process serves. A queue already made is
    left as it is."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:  # made already, or not this megatron
        yield
        return
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None


def initial_checkpoint(load: str | None, ref_load: str | None, resuming: bool) -> tuple[str, str] | None:
    """Where the policy's first weights come from when they are not the HF checkpoint's, as miles
    decides: ``--load`` when it is a torch_dist checkpoint; else, when nothing is resumed,
    ``--ref-load`` when it is one. Returns ``(path, flag)``."""
    if resuming:
        return None
    if torch_dist_dir(load) is not None:
        return str(load), "--load"
    if torch_dist_dir(ref_load) is not None:
        return str(ref_load), "--ref-load"
    return None


def check_backend_reads_torch_dist(train_backend: str, load: str | None, ref_load: str | None) -> None:
    """``ConfigError`` when a torch_dist checkpoint is named for a backend that cannot read it."""
    if train_backend == "megatron":
        return
    for flag, path in (("--load", load), ("--ref-load", ref_load)):
        if torch_dist_dir(path) is not None:
            raise ConfigError(f"{flag} {path} is a Megatron torch_dist checkpoint, which --train-backend "
                              f"{train_backend} cannot read: use --train-backend megatron or an HF checkpoint",
                              (flag, "--train-backend"))
