"""Unit tests are pure logic: they may not start Ray (integration tests do that)."""

from __future__ import annotations

from pathlib import Path

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


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tokenizer over the digits charset (the tiny models' vocabulary)."""
    from miles_disagg.models.tiny_qwen3 import DIGITS_CHARSET, build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(DIGITS_CHARSET).save_pretrained(path)
    return path
