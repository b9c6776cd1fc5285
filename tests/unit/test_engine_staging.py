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
