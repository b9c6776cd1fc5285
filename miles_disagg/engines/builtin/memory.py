"""Memory handoff of a colocated engine: SGLang's ``/release_memory_occupation``,
``/resume_memory_occupation`` and ``/update_weights_from_tensor`` for the built-in engine.

Tags are SGLang's (``ReleaseMemoryOccupationReqInput.tags``; none or empty = all of them):

* ``weights``: every parameter's storage is freed (the process gives the memory back: the
  allocator's cache on CUDA, ``malloc_trim`` on the host). Resuming allocates them again with
  undefined contents, as SGLang's memory saver does without a CPU backup, so generation stays
  refused until every parameter was loaded again (``/update_weights_from_tensor`` or
  ``/update_weights_from_disk``).
* ``kv_cache``: this engine allocates KV per running request, so an idle engine holds none;
  releasing it only refuses generation until it is resumed.
* ``cuda_graph``: this engine captures none; accepted, as SGLang accepts it.

Releasing needs an idle engine (no running or waiting request), as SGLang's scheduler asserts;
otherwise 409 and nothing changes. Every call runs on the scheduler thread, between steps.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import torch

from miles_disagg.engines.builtin.model_runner import ModelRunner
from miles_disagg.types import InvalidInput, Retryable

log = logging.getLogger(__name__)

WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)


class MemoryReleased(Retryable):
    """The engine's memory is released (``/resume_memory_occupation`` first); nothing changed."""


@dataclass
class _ParamLayout:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class MemoryState:
    """What is released, and which parameters still wait to be loaded after a resume."""

    released: set[str] = field(default_factory=set)
    unloaded: set[str] = field(default_factory=set)
    layouts: dict[str, _ParamLayout] = field(default_factory=dict)

    def check_can_generate(self) -> None:
        if self.released:
            raise MemoryReleased(f"memory is released ({', '.join(sorted(self.released))}); "
                                 "POST /resume_memory_occupation first")
        if self.unloaded:
            raise MemoryReleased(f"{len(self.unloaded)} parameters were resumed but not loaded yet, e.g. "
                                 f"{sorted(self.unloaded)[:2]}; POST /update_weights_from_tensor first")

    def release(self, runner: ModelRunner, tags: list[str] | None, busy: bool) -> list[str]:
        wanted = _tags(tags)
        if busy:
            raise Retryable("requests are running or waiting; memory is released only when the engine is idle "
                            "(pause with abort, or wait for them)")
        if WEIGHTS in wanted and WEIGHTS not in self.released:
            self._free_weights(runner)
        self.released |= set(wanted)
        return sorted(self.released)

    def resume(self, runner: ModelRunner, tags: list[str] | None) -> list[str]:
        wanted = _tags(tags)
        if WEIGHTS in wanted and WEIGHTS in self.released:
            self._allocate_weights(runner)
        self.released -= set(wanted)
        return sorted(self.released)

    def loaded(self, names) -> None:
        """``names`` hold real values again (an update swapped them in)."""
        self.unloaded -= set(names)

    def _free_weights(self, runner: ModelRunner) -> None:
        seen: set[int] = set()
        for name, param in runner.params.items():
            self.layouts[name] = _ParamLayout(tuple(param.shape), param.dtype)
            if id(param) not in seen:
                seen.add(id(param))
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        give_memory_back(runner.device)
        log.info("released the weights of %d parameters", len(seen))

    def _allocate_weights(self, runner: ModelRunner) -> None:
        seen: set[int] = set()
        for name, param in runner.params.items():
            if id(param) not in seen:
                seen.add(id(param))
                layout = self.layouts[name]
                param.data = torch.empty(layout.shape, dtype=layout.dtype, device=param.device)
            self.unloaded.add(name)


def _tags(tags: list[str] | None) -> list[str]:
    if not tags:  # SGLang: none or an empty list means every tag
        return list(TAGS)
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise InvalidInput(f"unknown memory tags {unknown}; SGLang's tags are {list(TAGS)}")
    return list(tags)


def give_memory_back(device: torch.device) -> None:
    """Return freed memory to the system: the CUDA caching allocator's, or glibc's heap."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: large blocks were unmapped on free anyway
        pass
