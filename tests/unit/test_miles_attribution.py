"""A miles generate hook's own router calls are attributed to its sample (``rollout/attribution.py``),
and miles' class-based rollout and eval functions run (``rollout/hooks.py``), against a fake router."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fake_router import FakeRouter, digit_ids
from miles_disagg.config.actors import RolloutManagerConfig
from miles_disagg.config.components import RolloutConfig
from miles_disagg.rollout.attribution import CallLog
from miles_disagg.rollout.data import Prompt
from miles_disagg.rollout.generate import GenerationFailed, SamplingSettings
from miles_disagg.rollout.manager import RolloutManager
from miles_disagg.rollout.miles_compat import install_miles_imports
from miles_disagg.samples import Sample

pytestmark = pytest.mark.timeout(120)
HOOKS = "miles_hook_examples"


def make_manager(tokenizer_dir, router: FakeRouter, capacity: int = 2, **rollout) -> RolloutManager:
    config = RolloutConfig(**{"rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 6,
                              "max_weight_staleness": 1, **rollout})
    return RolloutManager(RolloutManagerConfig(rollout=config, router_url="http://router", hf_dir=str(tokenizer_dir)),
                          capacity_groups=capacity, http_transport=router.transport)


def test_plain_aiohttp_posts_to_the_router_address_are_recorded_per_call(tokenizer_dir):
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, custom_generate_function_path=f"{HOOKS}.two_posts_with_aiohttp")
        await manager.start()
        await manager.set_version(2)
        first = (await router.wait_requests(4))[:4]
        for request in first:
            assert request.min_version == 1  # the run's constraint, added to the hook's own body
            router.answer(request, 1, "12")
        for request in (await router.wait_requests(8))[4:8]:
            assert request.input_ids[-3:] == digit_ids("129")  # its first turn and the tool token
            router.answer(request, (1, 2), "34")
        batch = await manager.take(2, 2)
        for sample in (s for g in batch.groups for s in g.samples):
            assert sample.call_versions == [[1, 1], [1, 2]]
            assert (sample.weight_version_start, sample.weight_version_end) == (1, 2)
            assert sample.loss_mask == [1, 1, 0, 1, 1] and sample.response_logprobs[2] == 0.0
        assert batch.metrics["rollout/trained_token_ratio"] == pytest.approx(4 / 5)
        await manager.stop()

    asyncio.run(scenario())


def test_miles_post_and_args_engine_share_the_samples_log_in_order(tokenizer_dir):
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, custom_generate_function_path=f"{HOOKS}.post_then_engine")
        generating = asyncio.create_task(manager.generate(1, 0))
        for request in (await router.wait_requests(2))[:2]:
            router.answer(request, 0, "1")
        for request in (await router.wait_requests(4))[2:4]:
            router.answer(request, 1, "2")
        batch = await generating
        assert [s.call_versions for s in batch.groups[0].samples] == [[[0, 0], [1, 1]]] * 2
        await manager.stop()

    asyncio.run(scenario())


def test_an_evaluation_asks_the_hooks_calls_for_exactly_the_version(tokenizer_dir):
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, custom_generate_function_path=f"{HOOKS}.two_posts_with_aiohttp")
        evaluating = asyncio.create_task(manager.evaluate([Prompt(index=0, text="345", label=3)], 5,
                                                          SamplingSettings(6), n_samples=1))
        router.answer((await router.wait_requests(1))[0], 5, "67")
        request = (await router.wait_requests(2))[1]
        assert request.constraint == {"exact_version": 5}
        router.answer(request, 5, "01")
        assert (await evaluating)["version"] == 5.0
        await manager.stop()

    asyncio.run(scenario())


def test_a_request_after_its_sample_is_done_is_refused_naming_the_hook(tokenizer_dir):
    install_miles_imports()  # as loading a hook by its path does: this test imports the hook module first
    import miles_hook_examples

    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, custom_generate_function_path=f"{HOOKS}.leaks_its_address")
        generating = asyncio.create_task(manager.generate(1, 0))
        for request in await router.wait_requests(2):
            router.answer(request, 0)
        await generating
        async with httpx.AsyncClient() as client:
            late = await client.post(miles_hook_examples.LEAKED[0], json={"input_ids": [3, 4]})
        assert late.status_code == 409
        assert late.json()["error"]["message"].startswith(f"--custom-generate-function-path {HOOKS}.leaks_its_address:")
        assert len(router.requests) == 2  # not forwarded
        await manager.stop()

    asyncio.run(scenario())


def test_an_answer_without_versions_fails_the_sample_naming_the_hook():
    log = CallLog("--custom-generate-function-path my.hook")
    log.record_payload({"meta_info": {"weight_version_start": 3, "weight_version_end": 4}})
    log.record_payload([{"meta_info": {"weight_version": "default"}}])
    sample = Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0])
    with pytest.raises(GenerationFailed, match=r"^--custom-generate-function-path my.hook: .*no numeric weight"):
        log.apply(sample)
    ok = CallLog("hook")
    ok.record_payload({"meta_info": {"weight_version_start": "3", "weight_version_end": "4"}})
    ok.apply(sample)
    assert sample.call_versions == [[3, 4]] and (sample.weight_version_start, sample.weight_version_end) == (3, 4)


def test_a_class_based_rollout_function_makes_the_batch(tokenizer_dir):
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, rollout_function_path=f"{HOOKS}.GroupsRollout")
        generating = asyncio.create_task(manager.generate(2, 0))
        for request in (await router.wait_requests(2))[:2]:
            router.answer(request, 0)
        for request in (await router.wait_requests(4))[2:]:
            router.answer(request, 0)
        batch = await generating
        assert len(batch.groups) == 2 and batch.metrics["rollout/by_class"] == 1.0
        assert all(s.call_versions == [[0, 0]] and s.reward is not None for g in batch.groups for s in g.samples)
        await manager.stop()

    asyncio.run(scenario())


def test_a_class_based_eval_function_is_built_once_and_sees_each_evaluation(tokenizer_dir):
    async def scenario():
        router = FakeRouter()
        manager = make_manager(tokenizer_dir, router, eval_function_path=f"{HOOKS}.SyncEval")
        prompts = [Prompt(index=0, text="345", label=3)]
        first = await manager.evaluate_with_function(7, 5, {"a": prompts}, SamplingSettings(3), n_samples=1)
        second = await manager.evaluate_with_function(9, 6, {"b": prompts}, SamplingSettings(3), n_samples=1)
        assert first["eval/a"] == 7.0 and second["eval/b"] == 9.0 and "eval/a" not in second
        await manager.stop()

    asyncio.run(scenario())


def test_the_hook_address_refuses_hostile_bodies_and_imposes_the_runs_constraint():
    from miles_disagg.rollout.attribution import MAX_JSON_DEPTH, AttributionProxy

    async def scenario():
        router = FakeRouter()
        forwarding = httpx.AsyncClient(transport=router.transport)
        proxy = AttributionProxy(forwarding, "http://router", {}, lambda: (3, None), "--custom-generate-function-path x")
        async with proxy.slot() as (url, log), httpx.AsyncClient() as client:
            deep = '{"a": ' + "[" * (MAX_JSON_DEPTH + 2) + "]" * (MAX_JSON_DEPTH + 2) + "}"
            answers = [await client.post(f"{url}/generate", content=body) for body in (b"{not json", b"[1, 2]",
                                                                                        deep.encode())]
            assert [a.status_code for a in answers] == [400, 400, 400]
            assert all(a.json()["error"]["message"].startswith("--custom-generate-function-path x: /generate body")
                       for a in answers)
            assert (await client.get(f"{url}/health")).status_code == 404
            sent = asyncio.create_task(client.post(f"{url}/generate", json={
                "input_ids": [3, 4], "weight_version": {"min_version": 0}}))  # a hook cannot loosen the bound
            request = (await router.wait_requests(1))[0]
            assert request.constraint == {"min_version": 3}
            router.answer(request, 4, "5")
            assert (await sent).status_code == 200
        assert log.calls == [[4, 4]] and log.errors == [] and len(router.requests) == 1
        await proxy.close()
        await forwarding.aclose()

    asyncio.run(scenario())


def test_a_hook_request_lost_after_dispatch_gives_the_group_up(tokenizer_dir):
    """Rollout service (nothing is replayed): the hook sees a 502 and fails; the group is lost
    (``RequestLost``), not the run."""
    from miles_disagg.rollout.generate import RequestLost

    async def scenario():
        lost = httpx.MockTransport(lambda request: httpx.Response(502, json={"error": "worker failed"}))
        config = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=1, rollout_max_response_len=6,
                               custom_generate_function_path=f"{HOOKS}.two_posts_with_aiohttp",
                               rollout_service_url="http://service")
        manager = RolloutManager(RolloutManagerConfig(rollout=config, router_url="http://service",
                                                      hf_dir=str(tokenizer_dir)), http_transport=lost)
        with pytest.raises(RequestLost):
            await manager.generate(1, 0)
        await manager.stop()

    asyncio.run(scenario())


def _routing_meta(rows: int, shape, offset: int = 0) -> dict:
    import base64

    import numpy as np

    array = (np.arange(rows * shape.per_row, dtype="<i4") + offset).reshape(rows, shape.num_layers, shape.top_k)
    return {"weight_version_start": 1, "weight_version_end": 1,
            "routed_experts": base64.b64encode(array.tobytes()).decode()}, array


def test_direct_calls_carry_routing_each_position_from_the_first_call_that_ran_it():
    """MoE routing through a hook's own router calls: each call asks for all its positions; the
    sample keeps the first call's rows and takes only the new positions from later calls."""
    import numpy as np

    from miles_disagg.rollout.routed_experts import RoutingShape

    shape = RoutingShape(2, 2)
    log = CallLog("hook", routing=shape)
    first_meta, first = _routing_meta(4, shape)  # call 1: 5 tokens ran -> rows 0..3
    second_meta, second = _routing_meta(7, shape, offset=1000)  # call 2: 8 tokens -> rows 0..6
    log.record_payload({"meta_info": first_meta})
    log.record_payload({"meta_info": second_meta})
    sample = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5, 6, 7, 8], response_logprobs=[0.0] * 6)
    log.apply(sample)
    assert sample.rollout_routed_experts.shape == (7, 2, 2)
    assert np.array_equal(sample.rollout_routed_experts[:4], first)
    assert np.array_equal(sample.rollout_routed_experts[4:], second[4:])


def test_a_direct_call_without_routing_fails_the_sample_naming_the_hook():
    from miles_disagg.rollout.routed_experts import RoutingShape

    log = CallLog("--custom-generate-function-path my.hook", routing=RoutingShape(2, 2))
    log.record_payload({"meta_info": {"weight_version_start": 1, "weight_version_end": 1}})
    sample = Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0])
    with pytest.raises(GenerationFailed, match=r"^--custom-generate-function-path my.hook: .*routed_experts"):
        log.apply(sample)


def test_the_hook_address_asks_for_routing_when_the_run_replays_it():
    from miles_disagg.rollout.attribution import AttributionProxy
    from miles_disagg.rollout.routed_experts import RoutingShape

    async def scenario():
        router = FakeRouter()
        forwarding = httpx.AsyncClient(transport=router.transport)
        proxy = AttributionProxy(forwarding, "http://router", {}, lambda: (0, None), "hook", routing=RoutingShape(2, 2))
        async with proxy.slot() as (url, log), httpx.AsyncClient() as client:
            sent = asyncio.create_task(client.post(f"{url}/generate", json={"input_ids": [3, 4]}))
            request = (await router.wait_requests(1))[0]
            assert request.body["return_routed_experts"] is True and request.body["routed_experts_start_len"] == 0
            router.answer(request, 1, "5")
            await sent
        await proxy.close()
        await forwarding.aclose()

    asyncio.run(scenario())
