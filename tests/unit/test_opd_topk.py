"""Top-k on-policy distillation (miles' ``--opd-log-prob-top-k``): each strategy and weight mode on a
case worked out by hand, the answers and samples refused, the teachers by name, the requests a top-k
teacher is sent (through a fake teacher), the trainer taking the precomputed term, and the flags'
rules both ways."""

from __future__ import annotations

import asyncio
import json
from math import log

import httpx
import pytest
import torch

from miles_disagg.config import load_config
from miles_disagg.config.components import TrainConfig
from miles_disagg.rollout import opd_topk
from miles_disagg.rollout.generate import GenerationFailed
from miles_disagg.rollout.opd_topk import TopKError, TopKSettings
from miles_disagg.rollout.teacher import Teacher, TeacherRoutes
from miles_disagg.trainer.batches import pack
from miles_disagg.trainer.rollout_inputs import prepare_rollout
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError, InvalidInput

# One response position. Student: top-2 {1: .6, 2: .4}, and (scoring the teacher's ids) 3: .3.
# Teacher: top-2 {2: .5, 3: .5}, and (scoring the student's ids) 1: .2, 2: .5.
STUDENT_TOP = [[[log(.6), 1, None], [log(.4), 2, None]]]
TEACHER_META = {"input_top_logprobs": [None, [[log(.5), 2, None], [log(.5), 3, None]]],
                "input_token_ids_logprobs": [None, [[log(.2), 1, None], [log(.5), 2, None]]]}
STUDENT_META = {"input_token_ids_logprobs": [None, [[log(.4), 2, None], [log(.3), 3, None]]]}

# by hand: S the token set, w the weights, sum of w * (student - teacher)
HAND = {
    ("only-student", "student_p"): .6 * log(.6 / .2) + .4 * log(.4 / .5),          # S {1, 2}, w .6 .4
    ("only-student", "teacher_p"): 2 / 7 * log(3) + 5 / 7 * log(.8),              # w .2/.7 .5/.7
    ("only-student", "none"): .5 * log(3) + .5 * log(.8),
    ("only-teacher", "student_p"): 4 / 7 * log(.4 / .5) + 3 / 7 * log(.3 / .5),    # S {2, 3}, w .4/.7 .3/.7
    ("only-teacher", "teacher_p"): .5 * log(.8) + .5 * log(.6),
    ("intersection", "student_p"): log(.4 / .5),                                   # S {2}
    ("intersection", "none"): log(.4 / .5),
    ("union", "student_p"): (.6 * log(3) + .4 * log(.8) + .3 * log(.6)) / 1.3,     # S {1, 2, 3}
    ("union", "teacher_p"): (.2 * log(3) + .5 * log(.8) + .5 * log(.6)) / 1.2,
    ("union", "none"): (log(3) + log(.8) + log(.6)) / 3,
    ("xor", "student_p"): .6 * log(3) + .3 * log(.6),                              # S {1, 3}, not normalized
    ("xor", "teacher_p"): .2 * log(3) + .5 * log(.6),
    ("xor", "none"): log(3) + log(.6),
}


@pytest.mark.parametrize("strategy, mode", sorted(HAND))
def test_each_strategy_and_weight_mode_gives_the_hand_computed_term(strategy, mode) -> None:
    settings = TopKSettings(2, strategy, mode)
    got = opd_topk.reverse_kl(settings, 1, STUDENT_TOP if settings.student_top else None, TEACHER_META,
                              STUDENT_META if settings.student_on_teacher else None)
    assert got == pytest.approx([HAND[strategy, mode]], abs=1e-12)


def test_which_side_asks_what() -> None:
    sides = {s: (TopKSettings(2, s).student_top, TopKSettings(2, s).teacher_top,
                 TopKSettings(2, s).teacher_on_student, TopKSettings(2, s).student_on_teacher)
             for s in opd_topk.STRATEGIES}
    assert sides == {"only-student": (True, False, True, False), "only-teacher": (False, True, False, True),
                     "intersection": (True, True, False, False), "union": (True, True, True, True),
                     "xor": (True, True, True, True)}
    assert opd_topk.student_top_k(TopKSettings(3, "only-teacher")) == 0
    assert opd_topk.student_top_k(TopKSettings(3, "union")) == 3 and opd_topk.student_top_k(None) == 0
    with pytest.raises(ValueError):
        TopKSettings(0)


def test_an_empty_set_gives_zero_and_missing_logprobs_are_errors() -> None:
    settings = TopKSettings(2, "intersection")
    disjoint = {"input_top_logprobs": [None, [[log(.5), 7, None]]]}
    assert opd_topk.reverse_kl(settings, 1, STUDENT_TOP, disjoint, None) == [0.0]
    no_id_2 = {"input_token_ids_logprobs": [None, [[log(.2), 1, None]]]}
    with pytest.raises(TopKError, match="no teacher logprob of token 2 at response position 0"):
        opd_topk.reverse_kl(TopKSettings(2), 1, STUDENT_TOP, no_id_2, None)
    with pytest.raises(TopKError, match="the teacher's answer has no meta_info.input_token_ids_logprobs"):
        opd_topk.reverse_kl(TopKSettings(2), 1, STUDENT_TOP, {"input_top_logprobs": []}, None)
    with pytest.raises(TopKError, match="the student's scoring answer has no meta_info.input_token_ids_logprobs"):
        opd_topk.reverse_kl(TopKSettings(2, "union"), 1, STUDENT_TOP, TEACHER_META, {})
    with pytest.raises(TopKError, match="not a finite number"):
        opd_topk.to_map([[float("nan"), 3, None]])
    with pytest.raises(TopKError, match="no metadata"):
        opd_topk.student_rows({}, 1)
    with pytest.raises(TopKError, match="cover 1 positions, the response 2"):
        opd_topk.student_rows({opd_topk.STUDENT_TOP_KEY: STUDENT_TOP}, 2)


def test_the_id_requests_union_or_per_position() -> None:
    rows = [[[-.1, 5, None], [-.2, 3, None]], [[-.1, 3, None]]]
    union = opd_topk.ids_body([1, 2, 9, 9], rows, 2, TopKSettings(2), top_k=2)
    assert union["token_ids_logprob"] == [3, 5] and union["top_logprobs_num"] == 2
    assert union["logprob_start_len"] == 0 and union["sampling_params"]["max_new_tokens"] == 0
    positions = opd_topk.ids_body([1, 2, 9, 9], rows, 2, TopKSettings(2, per_position=True))
    assert positions["token_ids_logprob_positions"] == [[], [], [5, 3], [3]] and "token_ids_logprob" not in positions
    metadata: dict = {}
    opd_topk.keep_student_top(metadata, {"output_top_logprobs": rows}, 2)
    opd_topk.pad_student_top(metadata, 1)
    assert metadata[opd_topk.STUDENT_TOP_KEY] == [*rows, []]
    with pytest.raises(TopKError, match="answered no output_top_logprobs rows for 2"):
        opd_topk.keep_student_top({}, {}, 2)


def test_teachers_by_name_with_the_default_fallback() -> None:
    routes = TeacherRoutes(named={"math": "http://m:1/generate", "default": "http://d:1/generate"})
    def sample(meta):
        return Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[-1.0], metadata=meta)
    assert routes.url_for(sample({"opd_teacher": "math"})) == "http://m:1/generate"
    assert routes.url_for(sample({"opd_teacher": "code"})) == routes.url_for(sample({})) == "http://d:1/generate"
    strict = TeacherRoutes(named={"math": "http://m:1/generate"}, key="domain")
    assert strict.url_for(sample({"domain": "math"})) == "http://m:1/generate"
    with pytest.raises(GenerationFailed, match="'code' names none of the --opd-teacher-urls teachers"):
        strict.url_for(sample({"domain": "code"}))
    with pytest.raises(GenerationFailed, match="has no 'domain'"):
        strict.url_for(sample({}))


def fake_teacher(seen: list):
    """SGLang's answers to a scoring call: input logprobs -p/10 at position p, each asked id -id/100."""
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        tokens = body["input_ids"]
        meta = {"weight_version": request.url.host,
                "input_token_logprobs": [[None if p == 0 else -p / 10, t, None] for p, t in enumerate(tokens)]}
        if body.get("top_logprobs_num"):
            meta["input_top_logprobs"] = [None] + [[[-0.1, 4, None], [-0.2, 5, None]] for _ in tokens[1:]]
        if body.get("token_ids_logprob"):
            meta["input_token_ids_logprobs"] = [None] + [[[-i / 100, i, None] for i in body["token_ids_logprob"]]
                                                         for _ in tokens[1:]]
        return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": meta})
    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def test_a_top_k_teacher_is_asked_by_name_and_each_token_gets_its_term() -> None:
    seen: list = []
    routes = TeacherRoutes(named={"math": "http://math:1/generate", "default": "http://other:1/generate"})
    samples = [Sample(prompt_ids=[1, 2], response_ids=[3, 6], response_logprobs=[-1.0] * 2,
                      metadata={"opd_teacher": name, opd_topk.STUDENT_TOP_KEY: [[[log(.5), 4, None]],
                                                                               [[log(.25), 7, None]]]})
               for name in ("math", "code")]
    teacher = Teacher(fake_teacher(seen), routes, topk=TopKSettings(1, "only-student", "none"))
    asyncio.run(teacher.score(samples))
    assert sorted(host for host, _ in seen) == ["math", "other"]
    for _, body in seen:
        assert body["token_ids_logprob"] == [4, 7] and "top_logprobs_num" not in body
    for sample, version in zip(samples, ("math", "other")):
        assert sample.teacher_version == version and sample.teacher_logprobs == pytest.approx([-0.2, -0.3])
        assert sample.opd_reverse_kl == pytest.approx([log(.5) + 0.04, log(.25) + 0.07])
        sample.check_consistent()
    with pytest.raises(ValueError, match="needs the student's engines"):
        Teacher(fake_teacher([]), routes, topk=TopKSettings(1, "union"))


def test_the_trainer_takes_the_precomputed_term_in_place_of_student_minus_teacher() -> None:
    samples = [Sample(prompt_ids=[1], response_ids=[2, 3], response_logprobs=[-1.0, -2.0], advantage=1.0,
                      teacher_logprobs=[-5.0, -5.0], opd_reverse_kl=[0.25, -0.5]),
               Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[-1.0], advantage=-1.0,
                      teacher_logprobs=[-5.0], opd_reverse_kl=[2.0])]
    config = TrainConfig(use_opd=True, opd_type="sglang", opd_kl_coef=0.5)
    frozen = prepare_rollout(config, [[pack(samples)]], [torch.full((2, 2), -1.0)], [None]).micro[0]
    assert frozen.advantages.tolist() == [[1.0 - 0.125, 1.0 + 0.25], [-1.0 - 1.0, 0.0]]
    samples[1].opd_reverse_kl = None
    with pytest.raises(ValueError, match="sample 1: none opd_reverse_kl terms"):
        pack(samples)
    samples[1].opd_reverse_kl = [1.0, 2.0]
    with pytest.raises(InvalidInput, match="2 opd_reverse_kl terms"):
        samples[1].check_consistent()


# ------------------------------------------------------------------ the flags

BASE = ["--train-backend", "fsdp", "--hf-checkpoint", "/tmp/none", "--rollout-batch-size", "2",
        "--global-batch-size", "2"]
OPD = ["--use-opd", "--opd-type", "sglang"]


def config_of(*flags: str):
    return load_config([*BASE, *flags], entry="train")[0]


def test_miles_defaults_and_accepted_forms() -> None:
    rollout = config_of().rollout
    assert (rollout.opd_log_prob_top_k, rollout.opd_top_k_strategy, rollout.opd_reward_weight_mode,
            rollout.opd_topk_per_position, rollout.opd_teacher_urls, rollout.opd_teacher_key) == \
        (0, "only-student", "student_p", False, [], "opd_teacher")
    rollout = config_of(*OPD, "--rm-url", "http://t:1/generate", "--opd-log-prob-top-k", "4",
                        "--opd-top-k-strategy", "xor", "--opd-reward-weight-mode", "none",
                        "--opd-topk-per-position").rollout
    assert (rollout.opd_log_prob_top_k, rollout.opd_top_k_strategy, rollout.opd_reward_weight_mode,
            rollout.opd_topk_per_position) == (4, "xor", "none", True)
    rollout = config_of(*OPD, "--opd-teacher-urls", "math=http://m:1/generate", "default=http://d:2",
                        "--opd-teacher-key", "domain").rollout
    assert rollout.opd_teacher_urls == ["math=http://m:1/generate", "default=http://d:2"]
    assert rollout.opd_teacher_key == "domain"
    # miles takes the top-k flags without --use-opd (they do nothing there)
    assert config_of("--opd-log-prob-top-k", "8", "--opd-top-k-strategy", "union").rollout.opd_log_prob_top_k == 8


@pytest.mark.parametrize("flags, named", [
    ([*OPD, "--rm-url", "http://t:1/generate", "--opd-log-prob-top-k", "-1"], "must be non-negative"),
    (["--opd-teacher-urls", "math=http://m:1/generate"], "set without --use-opd"),
    ([*OPD, "--opd-teacher-urls", "math"], "expected NAME=URL"),
    ([*OPD, "--opd-teacher-urls", "math=http://m:1/generate", "math=http://n:1/generate"], "twice"),
    ([*OPD, "--opd-teacher-urls", "math=m:1"], "--opd-teacher-urls 'math=m:1': expected"),
    ([*OPD, "--opd-teacher-urls", "math=http://m:1/generate", "--rm-url", "http://t:1/generate"], "give one"),
    ([*OPD, "--rm-url", "http://t:1/generate", "--opd-top-k-strategy", "both"], "--opd-top-k-strategy"),
    ([*OPD, "--rm-url", "http://t:1/generate", "--opd-reward-weight-mode", "p"], "--opd-reward-weight-mode"),
])
def test_refused_forms_name_their_flags(flags, named) -> None:
    with pytest.raises(ConfigError) as info:
        config_of(*flags)
    assert named in str(info.value) and "\n" not in str(info.value)
