"""The rollout manager's producer window, driven deterministically through a fake router.

The case of issue 16: with ``--max-weight-staleness 0`` every group in flight or buffered turns
stale at once when the trainer publishes a version. Those groups must give their window slots
back as they are dropped, or the producer never asks for the new version and the trainer waits
forever. Every step here is an explicit event (a request arriving, an answer given); nothing sleeps.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fake_router import FakeRouter, wait_until
from miles_disagg.config.actors import RolloutManagerConfig
from miles_disagg.config.components import RolloutConfig
from miles_disagg.rollout.manager import RolloutManager

pytestmark = pytest.mark.timeout(120)


def make_manager(tokenizer_dir: Path, router: FakeRouter, *, capacity: int, **rollout) -> RolloutManager:
    config = RolloutConfig(**{"rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 3,
                              "max_weight_staleness": 0, **rollout})
    return RolloutManager(RolloutManagerConfig(rollout=config, router_url="http://router", hf_dir=str(tokenizer_dir)),
                          capacity_groups=capacity, http_transport=router.transport)


def test_a_window_that_turns_stale_at_once_refills_with_the_new_version(tokenizer_dir):
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, capacity=4)
        await manager.start()
        first = await router.wait_requests(4)  # the window: 4 groups in flight
        assert [r.min_version for r in first] == [0] * 4
        for request in first[:2]:
            router.answer(request, 0)
        batch = await manager.take(2, 0)
        assert batch.metrics["rollout/staleness_max"] == 0
        refill = await router.wait_requests(6)  # the two taken groups' slots are reused
        for request in refill[2:4]:
            router.answer(request, 0)
        await wait_until(lambda: len(manager.buffer) == 2, "two v0 groups buffered")
        # now: 2 buffered and 2 in flight, all on v0; the trainer publishes v1 (K = 0)
        await manager.set_version(1)
        take = asyncio.create_task(manager.take(2, 1))
        fresh = await router.wait_requests(8)  # the dropped groups' slots went back to the producer
        assert [r.min_version for r in fresh[6:8]] == [1, 1]
        for request in refill[4:6]:  # the in-flight v0 groups arrive stale while the take waits
            router.answer(request, 0)
        more = await router.wait_requests(10)
        assert [r.min_version for r in more[8:10]] == [1, 1]
        for request in more[6:10]:
            router.answer(request, 1)
        batch = await take
        samples = [s for g in batch.groups for s in g.samples]
        assert len(batch.groups) == 2 and all(s.weight_version_start == 1 for s in samples)
        assert batch.metrics["rollout/staleness_max"] == 0
        assert batch.metrics["rollout/stale_groups_dropped"] == 4
        assert manager.data_position() == manager.drawn - manager.window.in_window
        await manager.stop()

    asyncio.run(scenario())


def test_activation_slower_than_a_step_does_not_stall_the_producer(tokenizer_dir):
    """K = 1: the engines are still on v0 when the trainer is at v2; the whole window (v0) is stale."""
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, capacity=4, max_weight_staleness=1)
        await manager.start()
        first = await router.wait_requests(4)
        for request in first[:2]:
            router.answer(request, 0)
        await manager.take(2, 0)
        await manager.set_version(1)
        window = await router.wait_requests(6)
        for request in window[2:6]:
            router.answer(request, 0)  # still v0: admissible at v1 (K = 1)
        await wait_until(lambda: len(manager.buffer) == 4, "the window buffered")
        await manager.take(2, 1)
        await manager.set_version(2)  # activation of v1 never happened: v0 is now too old
        later = await router.wait_requests(10)
        assert [r.min_version for r in later[6:10]] == [1] * 4
        for request in later[6:10]:
            router.answer(request, 1)
        batch = await manager.take(2, 2)
        assert batch.metrics["rollout/staleness_max"] == 1
        assert batch.metrics["rollout/stale_groups_dropped"] == 2
        await manager.stop()

    asyncio.run(scenario())


def test_dynamic_filter_replaces_zero_variance_groups_and_counts_them(tokenizer_dir):
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, capacity=4, max_weight_staleness=None,
                               dynamic_sampling_filter_path="miles_disagg.rollout.filters.check_reward_nonzero_std")
        await manager.start()
        first = await router.wait_requests(4)
        for request in first:  # every sample of a group says the same: equal rewards
            router.answer(request, 0, "000")
        replacements = await router.wait_requests(8)  # four filtered groups: four new ones
        for request in replacements[4:8]:
            router.answer(request, 0, ["000", prompt_continuation(request)])
        batch = await manager.take(2, 0)
        assert len(batch.groups) == 2
        for group in batch.groups:
            rewards = [s.reward for s in group.samples]
            assert len(set(rewards)) > 1, rewards
        assert batch.metrics["rollout/dynamic_filtered_groups"] == 4
        assert batch.metrics["rollout/dynamic_filter/drop_zero_std_0.0"] == 4
        rest = await manager.take(2, 0)
        assert rest.metrics["rollout/dynamic_filtered_groups"] == 0
        await manager.stop()

    asyncio.run(scenario())


def prompt_continuation(request) -> str:
    """The correct count-up continuation of a request's prompt (reward 1.0)."""
    last = request.input_ids[0][-1] - 3
    return "".join(str((last + i) % 10) for i in range(1, 4))


def test_sync_dynamic_sampling_over_samples_until_the_batch_is_full(tokenizer_dir):
    """train.py: prompts are drawn --over-sampling-batch-size at a time until enough groups pass the filter."""
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, capacity=4, max_weight_staleness=None,
                               over_sampling_batch_size=3,
                               dynamic_sampling_filter_path="miles_disagg.rollout.filters.check_reward_nonzero_std")
        generating = asyncio.create_task(manager.generate(2, 0))
        first = await router.wait_requests(3)  # one over-sampling draw: 3 groups
        router.answer(first[0], 0, ["000", prompt_continuation(first[0])])
        router.answer(first[1], 0, "000")
        router.answer(first[2], 0, "000")
        second = await router.wait_requests(6)  # one kept of three: another draw of 3
        router.answer(second[4], 0, ["000", prompt_continuation(second[4])])
        batch = await generating  # the other two of the second draw are no longer needed
        assert len(batch.groups) == 2 and manager.drawn == 6
        assert all(len({s.reward for s in g.samples}) > 1 for g in batch.groups)
        assert batch.metrics["rollout/dynamic_filtered_groups"] == 2
        await manager.stop()

    asyncio.run(scenario())
