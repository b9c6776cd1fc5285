"""Unit tests are pure logic: they may not start Ray (integration tests do that)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import ray
    except ImportError:
        return

    def refuse(*_args, **_kwargs):
        raise RuntimeError("unit tests may not start Ray; move this test to tests/integration")

    monkeypatch.setattr(ray, "init", refuse)
