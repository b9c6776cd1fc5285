"""The forwarded-hop count (``router/hops.py``): a loop of routers ends after a bounded number of hops."""

from __future__ import annotations

import pickle

import pytest

from miles_disagg.router.hops import HOPS_HEADER, MAX_HOPS, RouterLoop, forwarded_hops, hops_of
from miles_disagg.types import InvalidInput


def test_each_router_forwards_one_more_hop_than_it_received() -> None:
    assert hops_of({}) == 0 and forwarded_hops(0) == {HOPS_HEADER: "1"}
    assert hops_of({HOPS_HEADER: " 3 "}) == 3 and forwarded_hops(3) == {HOPS_HEADER: "4"}


def test_a_request_that_went_through_the_limit_is_a_router_loop() -> None:
    assert hops_of({HOPS_HEADER: str(MAX_HOPS - 1)}) == MAX_HOPS - 1
    with pytest.raises(RouterLoop, match=f"already went through {MAX_HOPS} routers") as loop:
        hops_of({HOPS_HEADER: str(MAX_HOPS)})
    copy = pickle.loads(pickle.dumps(loop.value))  # crosses process boundaries whole
    assert (copy.hops, copy.limit, str(copy)) == (MAX_HOPS, MAX_HOPS, str(loop.value))


@pytest.mark.parametrize("value", ["-1", "one", "1.5", "9" * 40, "١"])
def test_a_malformed_count_is_invalid_input(value: str) -> None:
    with pytest.raises(InvalidInput, match=HOPS_HEADER) as refused:
        hops_of({HOPS_HEADER: value})
    assert not isinstance(refused.value, RouterLoop)
