"""``pooled_http.run_loop``: asyncio.run on uvloop where installed; results and errors as asyncio.run's."""

from __future__ import annotations

import asyncio

import pytest

from miles_disagg.net.pooled_http import loop_factory, run_loop


def test_returns_the_result_on_the_fast_loop():
    async def which_loop():
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()).__module__

    module = run_loop(which_loop())
    expected = loop_factory()().__class__.__module__
    assert module == expected
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return
    assert module.startswith("uvloop")


def test_raises_the_coroutines_error_and_can_run_again():
    async def fail():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_loop(fail())
    assert run_loop(asyncio.sleep(0, result=7)) == 7
