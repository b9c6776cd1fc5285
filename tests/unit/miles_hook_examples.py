"""Generate hooks written the way miles' examples are: they POST to the router address in ``args``
themselves (loaded by dotted path in ``test_miles_attribution.py``)."""

from __future__ import annotations

import aiohttp
from miles.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from miles.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from miles.utils.http_utils import post
from miles.utils.types import Sample


async def two_posts_with_aiohttp(args, sample: Sample, sampling_params) -> Sample:
    """Two turns, each a plain aiohttp POST with an ``input_ids`` body; a tool token masked between them."""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = list(sample.prompt_ids)
    ids, mask, lps = [], [], []
    for turn in range(2):
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json={"input_ids": prompt_ids + ids, "return_logprob": True,
                                               "sampling_params": {**state.sampling_params, "max_new_tokens": 2}}) as r:
                assert r.status == 200, await r.text()
                output = await r.json()
        triples = output["meta_info"]["output_token_logprobs"]
        ids, mask, lps = ids + [t[1] for t in triples], mask + [1] * len(triples), lps + [t[0] for t in triples]
        if turn == 0:
            ids, mask, lps = ids + [12], mask + [0], lps + [0.0]  # the tool's "9"
    sample.tokens = prompt_ids + ids
    sample.response_length = len(ids)
    sample.loss_mask, sample.rollout_log_probs = mask, lps
    sample.response = state.tokenizer.decode(ids)
    return sample


async def post_then_engine(args, sample: Sample, sampling_params) -> Sample:
    """miles' ``post`` first, then ``args.engine``: both calls land in the sample's log, in order."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, {"input_ids": sample.tokens, "sampling_params": {"max_new_tokens": 1},
                              "return_logprob": True})
    triples = output["meta_info"]["output_token_logprobs"]
    sample.append_response([t[1] for t in triples], [t[0] for t in triples], trained=True)
    return await args.engine.generate(sample, {**sampling_params, "max_new_tokens": 1})


LEAKED: list[str] = []


async def leaks_its_address(args, sample: Sample, sampling_params) -> Sample:
    """Remembers its router address (a later request there has no sample to be attributed to)."""
    LEAKED.append(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate")
    return await args.engine.generate(sample, sampling_params)


class GroupsRollout:
    """miles' class-based rollout function."""

    def __init__(self, input):
        self.args, self.data_source = input.args, input.data_source

    async def __call__(self, input) -> RolloutFnTrainOutput:
        groups = self.data_source.get_samples(self.args.rollout_batch_size)
        done = [await generate_and_rm_group(self.args, group, self.args.sampling_params) for group in groups]
        return RolloutFnTrainOutput(samples=done, metrics={"rollout/by_class": 1.0})


class SyncEval:
    """miles' class-based eval function with a plain (synchronous) ``__call__`` returning data only."""

    def __init__(self, input):
        self.args, self.data_source = input.args, input.data_source

    def __call__(self, input) -> RolloutFnEvalOutput:
        return RolloutFnEvalOutput(data={name: {"rewards": [float(input.rollout_id)] * len(groups)}
                                         for name, groups in self.data_source.datasets.items()})
