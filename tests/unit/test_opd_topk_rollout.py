"""Top-k OPD through the rollout manager, against a fake router and a fake teacher: a training
group's generation call asks for the student's top-K (``top_logprobs_num``) and every sample keeps one
row per response token (a tool's tokens get empty rows), the teacher is asked for its top-K and its
logprobs of the student's ids, the student's engines (through the router, with the training request's
version constraint) for theirs of the teacher's ids, each sample leaves with one term per response
token, and the teacher is the one ``--opd-teacher-urls`` routes it to. An engine that does not answer
``top_logprobs_num`` stops the run with one line."""

from __future__ import annotations

import asyncio
import json
from math import exp
from pathlib import Path

import httpx
import pytest

from miles_disagg.config.actors import RolloutManagerConfig
from miles_disagg.config.components import RolloutConfig
from miles_disagg.rollout.generate import GenerationFailed
from miles_disagg.rollout.debug_data import load_groups, save_groups
from miles_disagg.rollout.manager import RolloutManager
from miles_disagg.rollout.opd_topk import STUDENT_TOP_KEY
from miles_disagg.samples import Group

pytestmark = pytest.mark.timeout(120)
K = 2


class Fakes:
    """The router (host ``router``: generation and the student's scoring) and teachers (other hosts):
    at every position the top ids are 3 and 4, each asked id ``i`` gets ``-i / 100``."""

    def __init__(self, answer_top: bool = True):
        self.calls: list[tuple[str, dict]] = []
        self.answer_top = answer_top
        self.transport = httpx.MockTransport(self._handle)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.calls.append((request.url.host, body))
        batched = isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batched else [body["input_ids"]]
        results = [self._result(body, prompt) for prompt in prompts]
        return httpx.Response(200, json=results if batched else results[0])

    def _result(self, body: dict, prompt: list[int]) -> dict:
        new = body["sampling_params"].get("max_new_tokens", 0)
        ids = [5, 6][:new]
        top = [[-0.1, 3, None], [-0.2, 4, None]]
        meta = {"output_token_logprobs": [[-0.5, i, None] for i in ids], "finish_reason": {"type": "length"},
                "weight_version": "2", "weight_version_start": 2, "weight_version_end": 2}
        if body.get("top_logprobs_num") and self.answer_top:
            meta["output_top_logprobs"] = [top for _ in ids]
        if body.get("logprob_start_len") == 0:
            meta["input_token_logprobs"] = [[None if p == 0 else -0.3, t, None] for p, t in enumerate(prompt)]
            if body.get("top_logprobs_num"):
                meta["input_top_logprobs"] = [None] + [top for _ in prompt[1:]]
            if body.get("token_ids_logprob"):
                meta["input_token_ids_logprobs"] = [None] + [[[-i / 100, i, None] for i in body["token_ids_logprob"]]
                                                             for _ in prompt[1:]]
        return {"text": "", "output_ids": ids, "meta_info": meta}


def make_manager(tokenizer_dir: Path, fakes: Fakes, teacher_url: str | None = "http://teacher:1/generate",
                 **rollout) -> RolloutManager:
    config = RolloutConfig(**{"rollout_batch_size": 1, "n_samples_per_prompt": 2, "rollout_max_response_len": 6,
                              "max_weight_staleness": 4, "opd_log_prob_top_k": K, "opd_top_k_strategy": "union",
                              **rollout})
    return RolloutManager(RolloutManagerConfig(rollout=config, router_url="http://router", hf_dir=str(tokenizer_dir),
                                               opd_teacher_url=teacher_url, use_opd=True),
                          capacity_groups=2, http_transport=fakes.transport)


def generate(manager: RolloutManager, version: int = 4):
    async def scenario():
        try:
            return await manager.generate(1, version)
        finally:
            await manager.stop()
    return [s for g in asyncio.run(scenario()).groups for s in g.samples]


def test_a_training_group_is_scored_by_top_k_on_both_sides(tokenizer_dir, tmp_path):
    fakes = Fakes()
    manager = make_manager(tokenizer_dir, fakes)
    samples = generate(manager)
    generation = [b for host, b in fakes.calls if host == "router" and b["sampling_params"]["max_new_tokens"] > 0]
    teacher = [b for host, b in fakes.calls if host == "teacher"]
    student = [b for host, b in fakes.calls if host == "router" and b["sampling_params"]["max_new_tokens"] == 0]
    assert len(generation) == 1 and generation[0]["top_logprobs_num"] == K
    assert len(teacher) == len(student) == len(samples) == 2
    for body in teacher:  # its top-K and its logprobs of the student's ids, no constraint to a teacher
        assert body["top_logprobs_num"] == K and body["token_ids_logprob"] == [3, 4] and "weight_version" not in body
    for body in student:  # the student's logprobs of the teacher's ids, as a training request is constrained
        assert body["token_ids_logprob"] == [3, 4] and "top_logprobs_num" not in body
        assert body["weight_version"] == {"min_version": 0}
    for sample in samples:
        assert sample.metadata[STUDENT_TOP_KEY] == [[[-0.1, 3, None], [-0.2, 4, None]]] * 2
        # S = {3, 4} at both positions: student from its top (-0.1, -0.2), teacher from its top (same)
        assert sample.opd_reverse_kl == pytest.approx([0.0, 0.0])
        assert sample.teacher_logprobs == [-0.3, -0.3] and sample.teacher_version == "2"
    # --save-debug-rollout-data / --load-debug-rollout-data keep the terms (a train-only run trains on them)
    save_groups(tmp_path / "0.jsonl", [Group(prompt_index=0, samples=samples)], consumed_at_version=4)
    (loaded,) = load_groups(tmp_path / "0.jsonl")
    assert [s.opd_reverse_kl for s in loaded.samples] == [s.opd_reverse_kl for s in samples]
    assert [s.metadata[STUDENT_TOP_KEY] for s in loaded.samples] == [s.metadata[STUDENT_TOP_KEY] for s in samples]


def test_a_tool_s_tokens_get_empty_rows_and_the_teacher_is_routed_by_name(tokenizer_dir):
    fakes = Fakes()
    manager = make_manager(tokenizer_dir, fakes, teacher_url=None, opd_top_k_strategy="only-student",
                           opd_teacher_urls=["default=http://fallback:1/generate", "math=http://math:1/generate"],
                           custom_generate_function_path="hook_examples.two_turns_with_a_tool")
    samples = generate(manager)
    assert {host for host, _ in fakes.calls} == {"router", "fallback"}  # no sample names a teacher
    for sample in samples:
        assert sample.loss_mask == [1, 1, 0, 0, 1, 1]
        rows = sample.metadata[STUDENT_TOP_KEY]
        assert [len(r) for r in rows] == [K, K, 0, 0, K, K]
        # only-student: S = {3, 4}; the teacher's logprobs of them -0.03, -0.04; tool positions: empty set
        term = (exp(-0.1) * (-0.1 + 0.03) + exp(-0.2) * (-0.2 + 0.04)) / (exp(-0.1) + exp(-0.2))
        assert sample.opd_reverse_kl == pytest.approx([term, term, 0.0, 0.0, term, term])


def test_an_engine_that_does_not_answer_top_logprobs_stops_the_run(tokenizer_dir):
    with pytest.raises(GenerationFailed, match="answered no output_top_logprobs rows"):
        generate(make_manager(tokenizer_dir, Fakes(answer_top=False)))
