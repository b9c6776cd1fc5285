"""GroupBuffer: staleness boundary, ordering, statistics, blocking, timeout, close, concurrency."""

from __future__ import annotations

import threading

import pytest

from miles_disagg.rollout.buffer import BufferClosed, BufferTimeout, GroupBuffer, TakeResult
from miles_disagg.samples import Group, Sample
from miles_disagg.types import InvalidInput, Retryable

pytestmark = pytest.mark.timeout(30)


def sample(start: int, end: int | None = None) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[-0.1],
                  weight_version_start=start, weight_version_end=start if end is None else end)


def group(index: int, *starts: int) -> Group:
    """A group whose samples started on ``starts`` (each ending on the same version)."""
    return Group(prompt_index=index, samples=[sample(s) for s in starts])


def prompt_indices(result: TakeResult) -> list[int]:
    return [g.prompt_index for g in result.groups]


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    """Run ``fn`` in a daemon thread; its result or exception lands in the returned dict."""
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = fn(*args, **kwargs)
        except Exception as exc:  # handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def wait_for_waiter(buffer: GroupBuffer, count: int = 1) -> None:
    """Spin (no sleeps) until ``count`` consumers are blocked in ``take``; the test timeout bounds it."""
    while buffer.num_waiting < count:
        threading.Event().wait(0.001)


# --------------------------------------------------------------------------- staleness rules


def test_staleness_exactly_k_is_kept_and_k_plus_one_dropped():
    buffer = GroupBuffer(max_weight_staleness=2)
    buffer.put(group(0, 7))  # 3 behind version 10: dropped
    buffer.put(group(1, 8))  # exactly 2 behind: kept
    buffer.put(group(2, 10, 7))  # its oldest sample decides: dropped
    buffer.put(group(3, 9))
    result = buffer.take(2, current_version=10)
    assert prompt_indices(result) == [1, 3]
    assert result.num_dropped == 2
    assert buffer.counters() == {"num_put": 4, "num_dropped": 2, "num_taken": 2, "num_buffered": 0}


def test_no_bound_keeps_everything():
    buffer = GroupBuffer(max_weight_staleness=None)
    for i in range(3):
        buffer.put(group(i, 0))
    result = buffer.take(3, current_version=1000)
    assert prompt_indices(result) == [0, 1, 2] and result.num_dropped == 0
    assert result.staleness_max == 1000
    assert buffer.admission_min_version(1000) is None


def test_k_zero_keeps_only_the_current_version():
    buffer = GroupBuffer(max_weight_staleness=0)
    buffer.put(group(0, 4))
    buffer.put(group(1, 5))
    buffer.put(group(2, 5, 5))
    result = buffer.take(2, current_version=5)
    assert prompt_indices(result) == [1, 2] and result.num_dropped == 1
    assert result.staleness_max == 0


def test_admission_min_version_is_current_minus_k_clipped_at_zero():
    buffer = GroupBuffer(max_weight_staleness=3)
    assert [buffer.admission_min_version(v) for v in (0, 2, 3, 4, 10)] == [0, 0, 0, 1, 7]
    assert GroupBuffer(0).admission_min_version(6) == 6


def test_groups_come_out_in_arrival_order_across_takes():
    buffer = GroupBuffer(max_weight_staleness=1)
    for i, version in enumerate([3, 1, 3, 2, 3, 3]):
        buffer.put(group(i, version))
    assert prompt_indices(buffer.take(2, current_version=3)) == [0, 2]  # 1 was dropped on the way
    assert prompt_indices(buffer.take(3, current_version=3)) == [3, 4, 5]
    assert len(buffer) == 0


def test_statistics_of_the_returned_samples():
    buffer = GroupBuffer(max_weight_staleness=4)
    buffer.put(Group(0, [sample(5, 6), sample(6)]))
    buffer.put(Group(1, [sample(3, 5), sample(2)]))  # oldest 2 = 6 - 4: kept
    buffer.put(group(2, 1))  # dropped
    result = buffer.take(2, current_version=6)
    # staleness per sample: 1, 0, 3, 4
    assert result.staleness_mean == pytest.approx(2.0)
    assert result.staleness_max == 4
    assert result.mixed_version_ratio == pytest.approx(0.5)
    assert result.metrics() == {
        "rollout/staleness_mean": pytest.approx(2.0),
        "rollout/staleness_max": 4.0,
        "rollout/stale_groups_dropped": 1.0,
        "rollout/mixed_version_ratio": pytest.approx(0.5),
    }


def test_drops_are_reported_once_by_the_next_successful_take():
    buffer = GroupBuffer(max_weight_staleness=0)
    buffer.put(group(0, 0))
    buffer.put(group(1, 1))
    with pytest.raises(BufferTimeout):
        buffer.take(2, current_version=1, timeout=0)  # drops group 0, then times out
    assert buffer.num_dropped == 1 and len(buffer) == 1  # the admissible group stays
    first = buffer.take(1, current_version=1)
    assert prompt_indices(first) == [1] and first.num_dropped == 1
    buffer.put(group(2, 1))
    assert buffer.take(1, current_version=1).num_dropped == 0


def test_current_version_may_not_go_back():
    buffer = GroupBuffer(max_weight_staleness=1)
    buffer.put(group(0, 5))
    buffer.take(1, current_version=5)
    with pytest.raises(InvalidInput, match="went back from 5 to 4"):
        buffer.take(1, current_version=4, timeout=0)


@pytest.mark.parametrize("call", [
    lambda b: b.take(0, current_version=1),
    lambda b: b.take(1, current_version=-1),
    lambda b: b.put(Group(prompt_index=0, samples=[])),
    lambda b: GroupBuffer(max_weight_staleness=-1),
    lambda b: GroupBuffer(max_weight_staleness=True),
])
def test_invalid_arguments(call):
    with pytest.raises(InvalidInput):
        call(GroupBuffer(max_weight_staleness=1))


# --------------------------------------------------------------------------- blocking, timeout, close


def test_take_blocks_until_enough_admissible_groups_arrive():
    buffer = GroupBuffer(max_weight_staleness=1)
    thread, outcome = in_thread(buffer.take, 2, 4)
    wait_for_waiter(buffer)
    buffer.put(group(0, 4))
    buffer.put(group(1, 2))  # stale: the woken consumer drops it and does not count it
    while buffer.counters()["num_dropped"] < 1:  # the consumer woke and scanned
        threading.Event().wait(0.001)
    assert "result" not in outcome and len(buffer) == 1
    buffer.put(group(2, 3))
    thread.join(10)
    assert prompt_indices(outcome["result"]) == [0, 2] and outcome["result"].num_dropped == 1


def test_timeout_raises_a_retryable_error_and_takes_nothing():
    buffer = GroupBuffer(max_weight_staleness=None)
    buffer.put(group(0, 0))
    with pytest.raises(BufferTimeout) as info:
        buffer.take(2, current_version=0, timeout=0.01)
    assert isinstance(info.value, Retryable)
    assert (info.value.requested, info.value.available) == (2, 1)
    assert len(buffer) == 1 and buffer.num_taken == 0


def test_close_wakes_every_waiter_and_refuses_later_calls():
    buffer = GroupBuffer(max_weight_staleness=None)
    waiters = [in_thread(buffer.take, 1, 0) for _ in range(2)]
    wait_for_waiter(buffer, 2)
    buffer.close()
    for thread, outcome in waiters:
        thread.join(10)
        assert isinstance(outcome.get("error"), BufferClosed)
    assert buffer.closed and buffer.num_waiting == 0
    with pytest.raises(BufferClosed):
        buffer.put(group(0, 0))
    with pytest.raises(BufferClosed):
        buffer.take(1, current_version=0, timeout=0)


def test_producer_and_consumer_threads_account_for_every_group():
    """Whatever the interleaving: nothing returned twice, nothing lost, nothing too stale returned."""
    buffer = GroupBuffer(max_weight_staleness=1)
    num_groups, batch = 60, 4
    consumer_version = [10]  # the trainer's version, read by the producer as 'what engines serve now'

    def produce():
        for i in range(num_groups):
            buffer.put(group(i, consumer_version[0] - (i % 3)))  # every third group is born 2 behind

    def consume():
        taken, dropped = [], 0
        while len(taken) + dropped < num_groups:
            try:
                result = buffer.take(batch, consumer_version[0], timeout=0.2)
            except BufferTimeout:
                if buffer.counters()["num_put"] == num_groups:
                    break  # producer done; the rest can no longer fill a batch
                continue
            assert all(g.oldest_version >= consumer_version[0] - 1 for g in result.groups)
            taken += prompt_indices(result)
            dropped += result.num_dropped
            consumer_version[0] += 1
        return taken, dropped

    producer, _ = in_thread(produce)
    consumer, outcome = in_thread(consume)
    producer.join(20)
    consumer.join(20)
    assert "error" not in outcome, outcome.get("error")
    taken, _ = outcome["result"]
    counters = buffer.counters()
    assert len(taken) == len(set(taken)) == counters["num_taken"]
    assert taken == sorted(taken)  # arrival order is preserved
    assert counters["num_put"] == num_groups
    assert counters["num_taken"] + counters["num_dropped"] + counters["num_buffered"] == num_groups
    assert counters["num_buffered"] < batch
    assert counters["num_dropped"] >= num_groups // 3  # at least the ones born too stale
