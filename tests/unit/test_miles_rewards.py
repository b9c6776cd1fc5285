"""Rewards with miles' signatures (``rollout/sample_rewards.py``) and miles' network-free ``--rm-type``s
(``rollout/miles_rm_types.py``)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from types import SimpleNamespace

import pytest

from miles_disagg.config.components import RolloutConfig
from miles_disagg.rollout.generate import GenerationFailed
from miles_disagg.rollout.miles_rm_types import dapo_score, f1_score, gpqa_reward, score_rm_type
from miles_disagg.rollout.sample_rewards import load_sample_reward
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError


@pytest.fixture
def miles_rewards(tmp_path, monkeypatch):
    (tmp_path / "miles_style_rewards.py").write_text(textwrap.dedent("""
        import asyncio

        async def reward_func(args, sample, **kwargs):
            await asyncio.sleep(0)
            return {"score": float(len(sample.response)), "acc": sample.response == sample.label}

        async def plain(args, sample, **kwargs):
            return 0.5

        async def group_reward(args, samples, **kwargs):
            best = max(len(s.response) for s in samples)
            return [1.0 if len(s.response) == best else 0.0 for s in samples]

        async def too_few(args):
            return 1.0

        def length_ours(prompt, response, label, metadata):
            return float(len(response))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "miles_style_rewards"
    sys.modules.pop("miles_style_rewards", None)


def samples(*responses: str, label="ab") -> list[Sample]:
    return [Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0], reward=None, response=r, label=label)
            for r in responses]


def score(reward, batch: list[Sample], evaluation: bool = False) -> list[float]:
    asyncio.run(reward.score(SimpleNamespace(evaluation=evaluation, rm_type=None), batch))
    return [s.reward for s in batch]


def test_an_async_dict_reward_is_read_through_the_reward_key(miles_rewards):
    reward = load_sample_reward(RolloutConfig(custom_rm_path=f"{miles_rewards}.reward_func", reward_key="score",
                                              eval_reward_key="acc"))
    batch = samples("ab", "abc")
    assert score(reward, batch) == [2.0, 3.0]
    assert batch[0].metadata["reward_details"] == {"score": 2.0, "acc": True}
    assert score(reward, samples("ab", "abc"), evaluation=True) == [1.0, 0.0]  # --eval-reward-key


def test_a_dict_reward_without_a_key_fails_naming_the_flag(miles_rewards):
    reward = load_sample_reward(RolloutConfig(custom_rm_path=f"{miles_rewards}.reward_func"))
    with pytest.raises(GenerationFailed, match="--reward-key"):
        score(reward, samples("ab"))


def test_group_rm_scores_a_group_in_one_call(miles_rewards):
    reward = load_sample_reward(RolloutConfig(custom_rm_path=f"{miles_rewards}.group_reward", group_rm=True))
    assert score(reward, samples("a", "abc", "ab")) == [0.0, 1.0, 0.0]


def test_this_projects_form_still_works_beside_miles(miles_rewards):
    ours = load_sample_reward(RolloutConfig(rm_type="math"))
    assert score(ours, samples("so \\boxed{12}", "7", label="12")) == [1.0, 0.0]
    theirs = load_sample_reward(RolloutConfig(custom_rm_path=f"{miles_rewards}:plain"))
    assert score(theirs, samples("x")) == [0.5]


def test_a_reward_a_generate_function_set_is_kept(miles_rewards):
    reward = load_sample_reward(RolloutConfig(custom_rm_path=f"{miles_rewards}.reward_func", reward_key="score"))
    batch = samples("abcd")
    batch[0].reward = {"score": 9.0}
    assert score(reward, batch) == [9.0]


@pytest.mark.parametrize("config, match", [
    ({"custom_rm_path": "miles_style_rewards.too_few"}, r"miles' form async def reward_func\(args, sample"),
    ({"custom_rm_path": "miles_style_rewards:length_ours", "group_rm": True}, "--group-rm scores a whole group"),
    ({"rm_type": "remote_rm"}, "--rm-type remote_rm is a miles reward that does not apply here: it posts"),
    ({"rm_type": "boxed_ifbench"}, "--rm-type ifbench is a miles reward that does not apply here"),
])
def test_refusals_name_the_flag(miles_rewards, config, match):
    with pytest.raises(ConfigError, match=match):
        load_sample_reward(RolloutConfig(**config))


def test_group_rm_without_a_custom_reward_scores_each_sample_as_miles_does():
    reward = load_sample_reward(RolloutConfig(rm_type="f1", group_rm=True))
    assert score(reward, samples("ab", "cd", label="ab")) == [1.0, 0.0]


def test_miles_rm_types_through_the_run_config():
    dapo = load_sample_reward(RolloutConfig(rm_type="dapo", reward_key="score"))
    assert score(dapo, samples("work\nAnswer: 42", "Answer: 41", label="42")) == [1.0, -1.0]
    boxed_f1 = load_sample_reward(RolloutConfig(rm_type="boxed_f1"))
    assert score(boxed_f1, samples("I think \\boxed{the Eiffel tower}", label="Eiffel Tower")) == [1.0]


def test_dapo_matches_miles_meaning():
    assert dapo_score("...\nAnswer: $\\boxed{1,000}$ dollars", "1000")["score"] == 1.0
    assert dapo_score("Answer: x = 18", "18.0") == {"score": 1.0, "acc": True, "pred": "18"}
    assert dapo_score("no answer line", "3") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert dapo_score("Answer: 3" + " " * 400, "3")["score"] == -1.0  # only the last 300 characters count


def test_f1_and_gpqa_match_miles_meaning():
    assert f1_score("The cat sat.", "a cat sat")[0] == pytest.approx(1.0)
    f1, precision, recall = f1_score("cat sat on mat", "cat sat")
    assert (precision, recall) == (0.5, 1.0) and f1 == pytest.approx(2 / 3)
    assert f1_score("yes", "no") == (0.0, 0.0, 0.0) and f1_score(None, "x") == (0.0, 0.0, 0.0)
    meta = {"choices": ["red", "green", "blue"]}
    assert gpqa_reward("<think>maybe A</think>The answer is B", "green", meta) == 1.0
    assert gpqa_reward("The answer is C", 1, meta) == 0.0
    assert gpqa_reward("it is clearly blue", "blue", meta) == 1.0
    assert score_rm_type("boxed_math", "so \\boxed{4}", "4", {}) == 1.0
    assert score_rm_type("random", "", None, {}) in (0, 1)
