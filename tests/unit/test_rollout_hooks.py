"""Rollout extension points with miles' contracts: loading and checking hooks by path, the custom
generate function (multi-turn with a masked tool turn, version attribution over the episode),
buffer filter, reward post-process, rollout and eval functions; miles' names on Sample."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from fake_router import FakeRouter, digit_ids, wait_until
from miles_disagg.config.actors import RolloutManagerConfig
from miles_disagg.config.components import RolloutConfig
from miles_disagg.rollout import hooks
from miles_disagg.rollout.generate import GenerationFailed, SamplingSettings
from miles_disagg.rollout.manager import RolloutManager
from miles_disagg.rollout.tasks import count_up_reward
from miles_disagg.samples import Sample, SampleStatus
from miles_disagg.types import ConfigError, asdict

pytestmark = pytest.mark.timeout(120)


def make_manager(tokenizer_dir: Path, router: FakeRouter, capacity: int = 4, **rollout) -> RolloutManager:
    config = RolloutConfig(**{"rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 6,
                              "max_weight_staleness": 1, **rollout})
    return RolloutManager(RolloutManagerConfig(rollout=config, router_url="http://router", hf_dir=str(tokenizer_dir)),
                          capacity_groups=capacity, http_transport=router.transport)


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize("spec", ["hook_examples.two_turns_with_a_tool", "hook_examples:two_turns_with_a_tool"])
def test_dotted_and_colon_paths_load_the_same_function(spec):
    import hook_examples

    assert hooks.load_hook(hooks.CUSTOM_GENERATE, spec) is hook_examples.two_turns_with_a_tool


@pytest.mark.parametrize("kind,spec,message", [
    (hooks.CUSTOM_GENERATE, "no_such_module_xyz.generate", "cannot import module"),
    (hooks.CUSTOM_GENERATE, "hook_examples.missing", "has no attribute 'missing'"),
    (hooks.CUSTOM_GENERATE, "hook_examples.generate_not_async", "must be an async def function"),
    (hooks.CUSTOM_GENERATE, "hook_examples.generate_too_few_arguments", "expected async def generate(args, sample"),
    (hooks.BUFFER_FILTER, "hook_examples.two_turns_with_a_tool", "must be a plain (synchronous) function"),
    (hooks.ROLLOUT_FUNCTION, "hook_examples.newest_first", "must be an async def function"),
    (hooks.DYNAMIC_FILTER, "justonename", "must be a dotted path"),
])
def test_bad_hooks_are_refused_with_the_flag(kind, spec, message):
    with pytest.raises(ConfigError) as info:
        hooks.load_hook(kind, spec)
    assert message in str(info.value) and kind.flag in str(info.value)
    assert info.value.flags == (kind.flag,)


def test_a_bad_hook_stops_the_launcher_before_anything_starts(tmp_path, capsys):
    from miles_disagg.launcher import main

    code = main("train_async", ["--config", str(Path(__file__).parents[2] / "configs/tiny_cpu.yaml"),
                                "--run-dir", str(tmp_path / "run"),
                                "--dynamic-sampling-filter-path", "hook_examples.generate_not_async"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dynamic-sampling-filter-path" in err[0]
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- Sample: miles' names


def test_sample_answers_to_miles_names_and_round_trips():
    sample = Sample(prompt_ids=[1, 2], response_ids=[], response_logprobs=[], status=SampleStatus.PENDING.value)
    sample.append_response([5, 6], [-0.1, -0.2], trained=True)
    sample.record_engine_call(3, 3)
    sample.append_response([7], trained=False)
    sample.append_response([8], [-0.3], trained=True)
    sample.record_engine_call(3, 4)
    assert sample.tokens == [1, 2, 5, 6, 7, 8] and sample.response_length == 4
    assert sample.loss_mask == [1, 1, 0, 1] and sample.effective_response_length == 3
    assert sample.rollout_log_probs == [-0.1, -0.2, 0.0, -0.3]
    assert (sample.weight_version_start, sample.weight_version_end) == (3, 4)
    assert sample.weight_versions == ["3", "4"]
    assert sample.status == Sample.Status.PENDING and Sample.Status.TRUNCATED == "truncated"
    sample.check_consistent()
    again = Sample(**json.loads(json.dumps(asdict(sample))))
    assert again == sample and again.tokens == sample.tokens


# --------------------------------------------------------------------------- custom generate


def test_multi_turn_generate_masks_the_tool_and_brackets_its_calls(tokenizer_dir):
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, capacity=2,
                               custom_generate_function_path="hook_examples.two_turns_with_a_tool")
        await manager.start()
        await manager.set_version(2)
        turn1 = (await router.wait_requests(4))[:4]  # 2 groups x 2 samples, first turns
        for request in turn1:
            assert request.num_samples == 1 and request.min_version == 1  # current - K
            assert request.body["sampling_params"]["max_new_tokens"] == 2
            router.answer(request, 1, "12")
        turn2 = (await router.wait_requests(8))[4:8]
        for request in turn2:
            assert request.input_ids[-4:] == digit_ids("1299")  # turn 1 and the tool's text, then the policy again
            router.answer(request, (1, 2), "34")
        batch = await manager.take(2, 2)
        for sample in (s for g in batch.groups for s in g.samples):
            assert sample.loss_mask == [1, 1, 0, 0, 1, 1]
            assert sample.response_logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
            assert sample.call_versions == [[1, 1], [1, 2]]
            assert sample.weight_version_start == sample.call_versions[0][0] == 1
            assert sample.weight_version_end == sample.call_versions[-1][1] == 2
            assert sample.response == "129934" and sample.metadata["turns"] == 2
            assert sample.reward == count_up_reward(sample.prompt, "129934", 6, {})  # the task's reward, on the text
        assert batch.metrics["rollout/trained_token_ratio"] == pytest.approx(4 / 6)
        assert batch.metrics["rollout/engine_calls_mean"] == 2
        await manager.stop()

    asyncio.run(scenario())


def test_a_generate_function_that_bypasses_the_engine_caller_fails_the_run(tokenizer_dir):
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router,
                               custom_generate_function_path="hook_examples.posts_around_the_router")
        await manager.start()
        await wait_until(lambda: manager.window.failure is not None, "the producer to fail")
        with pytest.raises(GenerationFailed, match="args.engine.generate"):
            await manager.take(2, 0)
        await manager.stop()

    asyncio.run(scenario())


# --------------------------------------------------------------------------- buffer filter, reward post-process


def test_buffer_filter_chooses_which_groups_a_take_returns(tokenizer_dir):
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, buffer_filter_path="hook_examples.newest_first")
        await manager.start()
        requests = await router.wait_requests(4)
        for request in requests:
            router.answer(request, 0)
        await wait_until(lambda: len(manager.buffer) == 4, "the window buffered")
        order = [g.prompt_index for g in manager.buffer._groups]
        batch = await manager.take(2, 0)
        assert [g.prompt_index for g in batch.groups] == order[::-1][:2]
        assert [g.prompt_index for g in manager.buffer._groups] == order[:2]
        await manager.stop()

    asyncio.run(scenario())


def test_a_buffer_filter_returning_foreign_groups_is_refused(tokenizer_dir):
    from miles_disagg.rollout.filters import FilterError

    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, buffer_filter_path="hook_examples.returns_foreign_groups")
        await manager.start()
        for request in await router.wait_requests(4):
            router.answer(request, 0)
        with pytest.raises(FilterError, match="taken from the buffer"):
            await manager.take(2, 0)
        await manager.stop()

    asyncio.run(scenario())


def test_reward_post_process_sets_the_advantages(tokenizer_dir):
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router,
                               custom_reward_post_process_path="hook_examples.minus_one_advantages")
        await manager.start()
        for request in await router.wait_requests(2):
            router.answer(request, 0)
        batch = await manager.take(2, 0)
        assert batch.advantages_given
        assert all(s.advantage == -1.0 for g in batch.groups for s in g.samples)
        await manager.stop()

    asyncio.run(scenario())


# --------------------------------------------------------------------------- rollout and eval functions


def test_rollout_function_makes_the_sync_batch(tokenizer_dir):
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, rollout_function_path="hook_examples.rollout_of_first_prompts")
        generating = asyncio.create_task(manager.generate(2, 0))
        first = await router.wait_requests(2)  # args.generate_group: one call per sample, first group
        for request in first:
            assert request.num_samples == 1 and request.min_version == 0
            router.answer(request, 0)
        for request in (await router.wait_requests(4))[2:]:
            router.answer(request, 0)
        batch = await generating
        assert len(batch.groups) == 2 and manager.drawn == 2
        assert all(s.call_versions == [[0, 0]] and s.reward is not None for g in batch.groups for s in g.samples)
        await manager.stop()

    asyncio.run(scenario())


def test_eval_function_asks_for_exactly_the_version(tokenizer_dir):
    from miles_disagg.rollout.data import Prompt

    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, eval_function_path="hook_examples.eval_each_dataset")
        prompts = [Prompt(index=0, text="345", label=3)]
        evaluating = asyncio.create_task(manager.evaluate_with_function(
            7, 5, {"counting": prompts}, SamplingSettings(3), n_samples=2))
        for request in await router.wait_requests(2):
            assert request.constraint == {"exact_version": 5}
            router.answer(request, 5, "678")
        metrics = await evaluating
        assert metrics == {"eval/counting": 1.0, "eval/counting_samples": 2.0, "eval/counting_version": 5.0}
        await manager.stop()

    asyncio.run(scenario())


# --------------------------------------------------------------------------- the built-in multi-turn task


def test_counter_tool_reward_scores_only_the_policys_characters():
    from miles_disagg.rollout.counter_tool import count_up_tool_reward, counter_tool

    assert counter_tool("34567") == "89" and counter_tool("9") == "01"
    # the tool's "01" counts up from the policy's 9, but it is not the policy's: no credit for it
    assert count_up_tool_reward("345", "990199", 4, {"policy_positions": [0, 1, 4, 5]}) == 0.0
    assert count_up_tool_reward("345", "678901", 4, {"policy_positions": [0, 1, 4, 5]}) == 1.0
    # the first character of the second turn follows the tool's last character
    assert count_up_tool_reward("345", "608923", 4, {"policy_positions": [0, 1, 4, 5]}) == 0.5
