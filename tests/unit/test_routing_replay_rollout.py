"""MoE routing replay, rollout side: requests carry SGLang's ``return_routed_experts`` field, the
answers' base64 int32 routing is decoded into ``Sample.rollout_routed_experts`` (one call; a
batched group; a two-turn sample whose turns two versions served, each position's row from the
call that first ran it), survives pickling and the debug-rollout JSONL, and a missing or
malformed answer stops the run with one line."""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
from pathlib import Path

import httpx
import numpy as np
import pytest

from miles_disagg.config.actors import RolloutManagerConfig
from miles_disagg.config.components import RolloutConfig
from miles_disagg.rollout.generate import GenerationFailed
from miles_disagg.rollout.debug_data import load_groups, save_groups
from miles_disagg.rollout.manager import RolloutManager
from miles_disagg.rollout.routed_experts import (
    RoutedExpertsMissing, RoutingShape, append_call_routing, decode_routed_experts)
from miles_disagg.samples import Sample

pytestmark = pytest.mark.timeout(120)

LAYERS, TOP_K = 3, 2
DENSE_LAYER = 0  # layer 0 has a dense MLP: -1 there, as SGLang reports it


def digit_ids(text: str) -> list[int]:
    return [int(ch) + 3 for ch in text]


def routing_row(version: int, position: int) -> np.ndarray:
    """What the fake engine routes the token at ``position`` to under ``version``: recognisable by both."""
    row = np.array([[version * 10000 + position * 100 + layer * 10 + k for k in range(TOP_K)]
                    for layer in range(LAYERS)], dtype=np.int32)
    row[DENSE_LAYER] = -1
    return row


def encode(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype("<i4").tobytes()).decode()


class RoutingRouter:
    """A router answering at once: outputs by turn, the version by turn, routing per SGLang's contract
    (``[seqlen - 1 - start_len, layers, top_k]`` from the call's own version). ``omit``: never include
    routing (an engine started without the flag); ``tamper``: change the payload."""

    def __init__(self, outputs=("12", "34"), versions=(3, 4), omit=False, tamper=None):
        self.outputs, self.versions, self.omit, self.tamper = outputs, versions, omit, tamper
        self.bodies: list[dict] = []
        self.transport = httpx.MockTransport(self._handle)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        turn = 1 if body.get("routed_experts_start_len", 0) > 0 else 0
        batched = isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batched else [body["input_ids"]]
        results = [self._result(body, prompt, turn) for prompt in prompts]
        return httpx.Response(200, json=results if batched else results[0])

    def _result(self, body: dict, prompt: list[int], turn: int) -> dict:
        version, ids = self.versions[turn], digit_ids(self.outputs[turn])
        meta = {"output_token_logprobs": [[-0.5, i, None] for i in ids], "finish_reason": {"type": "length"},
                "weight_version": str(version), "weight_version_start": version, "weight_version_end": version}
        if body.get("return_routed_experts") and not self.omit:
            start, seqlen = body.get("routed_experts_start_len", 0), len(prompt) + len(ids)
            rows = np.stack([routing_row(version, p) for p in range(start, seqlen - 1)])
            meta["routed_experts"] = encode(rows) if self.tamper is None else self.tamper(rows)
        return {"text": self.outputs[turn], "output_ids": ids, "meta_info": meta}


def make_manager(tokenizer_dir: Path, router: RoutingRouter, routed=(LAYERS, TOP_K), **rollout) -> RolloutManager:
    config = RolloutConfig(**{"rollout_batch_size": 1, "n_samples_per_prompt": 2, "rollout_max_response_len": 6,
                              "max_weight_staleness": 4, **rollout})
    return RolloutManager(RolloutManagerConfig(rollout=config, router_url="http://router", hf_dir=str(tokenizer_dir),
                                               routed_experts=routed),
                          capacity_groups=2, http_transport=router.transport)


def generate(manager: RolloutManager, n_groups: int = 1, version: int = 4):
    async def scenario():
        try:
            return await manager.generate(n_groups, version)
        finally:
            await manager.stop()
    return asyncio.run(scenario())


def samples_of(batch) -> list[Sample]:
    return [s for g in batch.groups for s in g.samples]


def test_a_batched_group_asks_for_routing_and_each_sample_keeps_its_rows(tokenizer_dir):
    router = RoutingRouter(outputs=("1234", "1234"))
    batch = generate(make_manager(tokenizer_dir, router))
    (body,) = router.bodies
    assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 0
    assert isinstance(body["input_ids"][0], list) and len(body["input_ids"]) == 2  # one batched request
    for sample in samples_of(batch):
        length = len(sample.prompt_ids) + len(sample.response_ids)
        routed = sample.rollout_routed_experts
        assert routed.dtype == np.int32 and routed.shape == (length - 1, LAYERS, TOP_K)
        assert all(np.array_equal(routed[p], routing_row(3, p)) for p in range(length - 1))
        assert (routed[:, DENSE_LAYER] == -1).all()


def test_a_two_turn_sample_served_by_two_versions_replays_each_calls_own_rows(tokenizer_dir):
    """Turn 1 by version 3, the tool's tokens, turn 2 by version 4: row p comes from the call
    that first ran position p (the last token of turn 1 and the tool tokens: call 2's prefill)."""
    router = RoutingRouter(outputs=("12", "34"), versions=(3, 4))
    manager = make_manager(tokenizer_dir, router, custom_generate_function_path="hook_examples.two_turns_with_a_tool")
    batch = generate(manager)
    for sample in samples_of(batch):
        prompt_len = len(sample.prompt_ids)
        assert sample.call_versions == [[3, 3], [4, 4]] and sample.loss_mask == [1, 1, 0, 0, 1, 1]
        routed = sample.rollout_routed_experts
        assert routed.shape == (prompt_len + 6 - 1, LAYERS, TOP_K)
        first_call_rows = prompt_len + 2 - 1  # prompt and turn 1, less turn 1's last token
        for p in range(routed.shape[0]):
            version = 3 if p < first_call_rows else 4
            assert np.array_equal(routed[p], routing_row(version, p)), (p, routed[p])
    second_turn = [b for b in router.bodies if b["routed_experts_start_len"] > 0]
    assert len(second_turn) == 2
    for body in second_turn:  # only the positions call 1 did not run
        assert body["routed_experts_start_len"] == len(body["input_ids"]) - 3  # turn 1's last token + 2 tool tokens


def test_no_routing_config_sends_no_routing_field(tokenizer_dir):
    router = RoutingRouter()
    batch = generate(make_manager(tokenizer_dir, router, routed=None))
    assert "return_routed_experts" not in router.bodies[0]
    assert all(s.rollout_routed_experts is None for s in samples_of(batch))


def test_an_answer_without_routing_stops_the_run_naming_the_engine_flag(tokenizer_dir):
    with pytest.raises(RoutedExpertsMissing, match="--enable-return-routed-experts") as info:
        generate(make_manager(tokenizer_dir, RoutingRouter(omit=True)))
    assert isinstance(info.value, GenerationFailed) and "\n" not in str(info.value)


@pytest.mark.parametrize("tamper, fragment", [
    (lambda rows: encode(rows[:-1]), "bytes;"),  # a row short
    (lambda rows: "%%%not base64", "not valid base64"),
    (lambda rows: encode(rows)[:-4] + "\n" + encode(rows)[-4:], "not valid base64"),  # newlines are not the contract
    (lambda rows: rows.tolist(), "must be a base64 string"),
])
def test_malformed_routing_is_refused(tokenizer_dir, tamper, fragment):
    with pytest.raises(RoutedExpertsMissing, match=fragment):
        generate(make_manager(tokenizer_dir, RoutingRouter(tamper=tamper)))


def test_tokens_appended_after_the_last_call_are_refused_not_trained_unreplayed(tokenizer_dir):
    router = RoutingRouter()
    manager = make_manager(tokenizer_dir, router, custom_generate_function_path="hook_examples.ends_with_a_tool")
    with pytest.raises(RoutedExpertsMissing, match="appended after its last engine call"):
        generate(manager)


def test_routing_survives_pickling_and_the_debug_rollout_jsonl(tokenizer_dir, tmp_path):
    batch = generate(make_manager(tokenizer_dir, RoutingRouter()))
    path = tmp_path / "rollout_0.jsonl"
    save_groups(path, batch.groups, consumed_at_version=4)
    assert isinstance(json.loads(path.read_text().splitlines()[0])["samples"][0]["rollout_routed_experts"], list)
    for original, loaded in zip(samples_of(batch), [s for g in load_groups(path) for s in g.samples]):
        assert loaded.rollout_routed_experts.dtype == np.int32
        assert np.array_equal(loaded.rollout_routed_experts, original.rollout_routed_experts)
        pickled = pickle.loads(pickle.dumps(original))
        assert np.array_equal(pickled.rollout_routed_experts, original.rollout_routed_experts)
    error = pickle.loads(pickle.dumps(RoutedExpertsMissing("no routing")))
    assert isinstance(error, RoutedExpertsMissing) and str(error) == "no routing"


def test_decode_follows_sglangs_layout():
    """Little-endian int32, C order [positions, layers, top_k], decoded as SGLang's own helper does."""
    rows = np.stack([routing_row(7, p) for p in range(4)])
    shape = RoutingShape(LAYERS, TOP_K)
    assert np.array_equal(decode_routed_experts({"routed_experts": encode(rows)}, 4, shape), rows)
    sample = Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=[0.0, 0.0])
    with pytest.raises(RoutedExpertsMissing, match="holds 0 rows"):
        append_call_routing(sample, {"routed_experts": encode(rows)}, start_len=1, seqlen=5, shape=shape)
    append_call_routing(sample, {"routed_experts": encode(rows)}, start_len=0, seqlen=5, shape=shape)
    assert sample.rollout_routed_experts.shape == (4, LAYERS, TOP_K)
