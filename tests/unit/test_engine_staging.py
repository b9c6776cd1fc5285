"""Which staged version an activation may use (no model needed)."""

from __future__ import annotations

from pathlib import Path

from miles_disagg.engines.builtin.staging import StagedVersion, Stager, version_ref_from_string
from miles_disagg.types import VersionRef


def _stager(live: VersionRef | None, staged: StagedVersion) -> Stager:
    stager = Stager(runner=None, base_dir=Path("."), live_ref=live)  # type: ignore[arg-type]
    stager.staged = staged
    return stager


def _staged(version: int, applies_onto: VersionRef | None) -> StagedVersion:
    return StagedVersion(VersionRef("run", version), Path("p"), {}, applies_onto, 0.0, 0.0)


def test_take_needs_the_staged_version_name():
    stager = _stager(VersionRef("run", 1), _staged(2, None))
    assert stager.take(None) is None and stager.take("3") is None
    assert stager.take("2").ref.version == 2
    assert stager.take("2") is None  # taken once


def test_a_delta_is_used_only_onto_the_version_it_was_staged_against():
    stager = _stager(VersionRef("run", 5), _staged(7, VersionRef("run", 6)))
    assert stager.take("7") is None  # live is 5, the delta was staged against 6
    stager.set_live(VersionRef("run", 6))
    assert stager.take("7") is not None


def test_start_up_base_matches_any_run():
    stager = _stager(version_ref_from_string("0"), _staged(1, VersionRef("run", 0)))
    assert stager.take("1") is not None
    assert version_ref_from_string("default") is None


# --------------------------------------------------------------------------- the swap, and nothing else, in the pause


def test_the_swap_hands_back_the_tensors_it_displaced():
    import torch

    from miles_disagg.engines.builtin.fused_experts import ExpertLayout

    params = {"w": torch.nn.Parameter(torch.zeros(4)), "b": torch.nn.Parameter(torch.zeros(2))}
    old = params["w"].data.data_ptr()
    new = torch.ones(4)
    displaced = ExpertLayout(params).swap_in(params, {"w": new})
    assert params["w"].data.data_ptr() == new.data_ptr()
    assert [t.data_ptr() for t in displaced] == [old]  # still allocated: the caller frees it


class _SchedulerThread:
    """``call(fn)`` runs ``fn(self)`` on a thread of its own and keeps the command afterwards, as the
    scheduler's loop keeps its last batch of commands until the next one arrives."""

    def __init__(self):
        self.kept: list = []
        self.freed_on: list[str] = []

    def call(self, fn):
        import concurrent.futures
        import threading

        future: concurrent.futures.Future = concurrent.futures.Future()
        self.kept.append(fn)
        worker = threading.Thread(target=lambda: future.set_result(fn(self)), name="scheduler")
        worker.start()
        worker.join()
        return future


def test_the_displaced_tensors_are_released_by_the_caller_not_in_the_pause():
    import threading
    import weakref

    import torch

    from miles_disagg.engines.builtin.weight_updates import between_steps

    scheduler = _SchedulerThread()
    held = [torch.zeros(1024)]
    gone = weakref.finalize(held[0], lambda: scheduler.freed_on.append(threading.current_thread().name))

    def swap(s, displaced: list) -> str:
        displaced.append(held.pop())  # what the swap displaced, still referenced
        return "swapped"

    assert between_steps(scheduler, swap) == "swapped"
    assert not gone.alive and scheduler.freed_on == [threading.current_thread().name]  # not "scheduler"
    assert scheduler.kept  # the scheduler still holds the command: the list was emptied, not dropped
