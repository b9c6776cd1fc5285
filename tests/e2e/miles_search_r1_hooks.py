"""A miles user's rollout code, written the way miles' search-r1 / retool examples are, run unchanged
(``--custom-generate-function-path miles_search_r1_hooks.generate`` with this directory on PYTHONPATH).

* ``generate``: miles' imports; POSTs to ``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate``
  itself - the first turn with miles' ``post`` and a ``text`` body, the second with a plain aiohttp
  client and an ``input_ids`` body; a "search" tool turn between them is masked out (``loss_mask`` 0);
  fills ``tokens``, ``response_length``, ``response``, ``loss_mask``, ``rollout_log_probs`` and
  ``status`` by hand and sets its own attribute (``sample.turns``).
* ``reward_func``: miles' ``async def reward_func(args, sample, **kwargs)`` returning a dict (read
  through ``--reward-key score``).
* ``SearchRollout`` / ``SearchEval``: miles' class-based rollout and eval functions
  (``--rollout-function-path`` / ``--eval-function-path``), generating through ``generate_and_rm_group``.
"""

from __future__ import annotations

import asyncio

import aiohttp
from miles.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from miles.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from miles.utils.http_utils import post
from miles.utils.types import Sample

from miles_disagg.rollout.counter_tool import count_up_tool_reward, counter_tool

TURN_TOKENS = 2


def _turn(output: dict) -> tuple[list[int], list[float], str]:
    triples = output["meta_info"]["output_token_logprobs"]
    return [t[1] for t in triples], [t[0] for t in triples], output["meta_info"]["finish_reason"]["type"]


async def generate(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    params = {**sampling_params, "max_new_tokens": TURN_TOKENS}
    response, response_ids, loss_mask, log_probs, policy_positions = "", [], [], [], []
    turns = 0
    for turn in range(2):
        async with state.semaphore:
            if turn == 0:
                output = await post(url, {"text": sample.prompt + response, "sampling_params": params,
                                          "return_logprob": True})
            else:
                async with aiohttp.ClientSession() as session:
                    async with session.post(url, json={"input_ids": prompt_ids + response_ids,
                                                       "sampling_params": params, "return_logprob": True}) as r:
                        r.raise_for_status()
                        output = await r.json()
        turns += 1
        ids, lps, finish = _turn(output)
        text = state.tokenizer.decode(ids, skip_special_tokens=True)
        policy_positions += range(len(response), len(response) + len(text))
        response, response_ids = response + text, response_ids + ids
        loss_mask, log_probs = loss_mask + [1] * len(ids), log_probs + lps
        if finish != "length" or turn == 1:
            break
        observation = counter_tool(sample.prompt + response)  # the "search" result
        obs_ids = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
        response, response_ids = response + observation, response_ids + obs_ids
        loss_mask, log_probs = loss_mask + [0] * len(obs_ids), log_probs + [0.0] * len(obs_ids)
    sample.tokens = prompt_ids + response_ids
    sample.response_length = len(response_ids)
    sample.response = response
    sample.loss_mask = loss_mask
    sample.rollout_log_probs = log_probs
    sample.turns = turns  # the hook's own attribute, as miles allows
    sample.metadata["policy_positions"] = policy_positions
    sample.metadata["turns"] = turns
    sample.status = Sample.Status.COMPLETED if finish == "stop" else Sample.Status.TRUNCATED
    return sample


async def reward_func(args, sample: Sample, **kwargs) -> dict:
    await asyncio.sleep(0)
    score = count_up_tool_reward(sample.prompt, sample.response, sample.label, sample.metadata)
    return {"score": score, "turns": sample.turns, "pred": sample.response}


class SearchRollout:
    """miles' class-based rollout function: one batch of groups, each through generate_and_rm_group."""

    def __init__(self, input):
        self.args, self.data_source, self.calls = input.args, input.data_source, 0

    async def __call__(self, input) -> RolloutFnTrainOutput:
        assert not input.evaluation
        self.calls += 1
        groups = self.data_source.get_samples(self.args.rollout_batch_size)
        done = await asyncio.gather(*(generate_and_rm_group(self.args, g, self.args.sampling_params)
                                      for g in groups))
        return RolloutFnTrainOutput(samples=list(done), metrics={"rollout/class_rollout_calls": self.calls})


class SearchEval:
    """miles' class-based eval function over the data source's eval sets."""

    def __init__(self, input):
        self.args, self.data_source = input.args, input.data_source

    async def __call__(self, input) -> RolloutFnEvalOutput:
        assert input.evaluation
        data = {}
        for name, groups in self.data_source.datasets.items():
            done = [s for g in groups for s in await generate_and_rm_group(self.args, g, self.args.sampling_params)]
            data[name] = {"rewards": [s.reward for s in done], "truncated": [s.status == "truncated" for s in done],
                          "samples": done}
        return RolloutFnEvalOutput(data=data, metrics={"class_eval_rollout_id": input.rollout_id})
