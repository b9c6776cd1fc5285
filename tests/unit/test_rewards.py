"""Rule-based math rewards: answer extraction, normalization, numeric matching, the registry."""

from __future__ import annotations

import sys
import textwrap

import pytest

from miles_disagg.rollout import rewards
from miles_disagg.rollout.answer_scoring import (
    answers_match,
    extract_deepscaler_answer,
    extract_math_answer,
    label_answers,
    last_boxed,
    normalize_answer,
)
from miles_disagg.rollout.rewards import RewardError, get_reward_fn, known_rewards, register_reward
from miles_disagg.types import ConfigError, InvalidInput

# --------------------------------------------------------------------------- extraction


@pytest.mark.parametrize("text, expected", [
    (r"first \boxed{1} then \boxed{2}", "2"),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
    (r"so $\boxed{x^{2}+1}$.", "x^{2}+1"),
    (r"\fbox{7}", "7"),
    (r"\boxed 5$", "5"),
    (r"\boxed{1} and finally \boxed{2", None),  # truncated last box: no answer
    ("no box here", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("response, expected", [
    (r"work \boxed{4}. Answer: 5", "4"),  # the box wins over Answer:
    ("lots of work\nAnswer: 12\nthanks", "12"),
    ("answer: 1\nfinal answer:  3 ", "3"),
    ("steps\n#### 72", "72"),
    ("Answer: 9\n#### 8", "9"),
    ("I do not know", None),
])
def test_extract_math_answer(response, expected):
    assert extract_math_answer(response) == expected


@pytest.mark.parametrize("response, expected", [
    (r"<think>maybe \boxed{2}</think> so \boxed{3}", "3"),
    (r"<think>still thinking \boxed{2}", None),  # thinking never closed
    (r"no think tags \boxed{4}", "4"),
    ("<think>x</think> Answer: 4", None),  # deepscaler counts only boxed answers
])
def test_extract_deepscaler_answer(response, expected):
    assert extract_deepscaler_answer(response) == expected


# --------------------------------------------------------------------------- normalization


@pytest.mark.parametrize("raw, expected", [
    (r"  $\dfrac{1}{2}$ ", r"\frac{1}{2}"),
    (r"\tfrac{3}{4}", r"\frac{3}{4}"),
    (r"\frac12", r"\frac{1}{2}"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"\left\{1\right\}", r"\{1\}"),
    (r"10\!000", "10000"),
    (r"1\,000", "1000"),
    (r"7\,cm", "7"),
    (r"x = 5.", "5"),
    (r"\theta=30^\circ", "30"),
    (r"90^{\circ}", "90"),
    (r"5 \text{ cm}", "5"),
    (r"10\text{ cm}^2", "10"),
    (r"\text{Evelyn}", "Evelyn"),
    (r"\textbf{(A)}", "(A)"),
    ("18 dollars", "18"),
    (r"\$5", "5"),
    (r"50\%", "50%"),
    (r"1{,}000", "1,000"),
    (r"{7}", "7"),
    (r"\sqrt2", r"\sqrt{2}"),
    (r"x^2 = y", "x^2=y"),  # only a leading single-variable assignment is dropped
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_normalize_keeps_commands_that_merely_start_like_left_right():
    assert normalize_answer(r"A \rightarrow B") == r"A\rightarrowB"


# --------------------------------------------------------------------------- matching


@pytest.mark.parametrize("predicted, label", [
    ("5", "5"),
    ("5.0", "5"),
    (".5", "0.5"),
    ("1/2", r"\frac{1}{2}"),
    (r"\dfrac{1}{2}", "0.5"),
    (r"-\frac{3}{4}", "-0.75"),
    (r"\frac{-3}{4}", "-3/4"),
    ("1,000", "1000"),
    ("1,234,567.5", "1234567.5"),
    ("50%", "50"),
    (r"50\%", "0.5"),
    ("0.3333333", "1/3"),  # within the relative tolerance
    (r"\sqrt{2}", r"\sqrt2"),
    (r"\text{(B)}", "(B)"),
])
def test_answers_match(predicted, label):
    assert answers_match(predicted, label)


@pytest.mark.parametrize("predicted, label", [
    ("6", "5"),
    ("0.333", "1/3"),  # outside the tolerance
    ("1,2", "12"),  # a pair, not a thousands separator
    ("", "0"),
    ("1/0", "0"),
    (r"\sqrt{8}", r"2\sqrt{2}"),  # no computer algebra, by design
    ("5", "-5"),
    ("1" * 100, "1" * 99 + "2"),  # too long for numeric parsing; differs as text
])
def test_answers_do_not_match(predicted, label):
    assert not answers_match(predicted, label)


def test_label_forms():
    assert label_answers(r"The answer is \boxed{42}") == ["42"]
    assert label_answers("reasoning\n#### 1,000") == ["1,000"]
    assert label_answers(7) == ["7"]
    assert label_answers(["3", 4]) == ["3", "4"]
    for bad in (None, True, {"a": 1}, []):
        with pytest.raises(InvalidInput):
            label_answers(bad)


def test_math_and_deepscaler_scores():
    math_fn, deepscaler_fn = get_reward_fn("math", None), get_reward_fn("deepscaler", None)
    assert math_fn("p", r"so \boxed{\dfrac{1}{2}}", "0.5", {}) == 1.0
    assert math_fn("p", "Answer: 1,000.", 1000, {}) == 1.0
    assert math_fn("p", "#### 41", "#### 42", {}) == 0.0
    assert math_fn("p", "no answer at all", "42", {}) == 0.0
    assert math_fn("p", "Answer: 3", ["2", "3"], {}) == 1.0
    assert deepscaler_fn("p", r"<think>\boxed{1}</think>The answer is \boxed{2}.", "2", {}) == 1.0
    assert deepscaler_fn("p", r"<think>\boxed{2}</think>The answer is 2.", "2", {}) == 0.0
    assert deepscaler_fn("p", "Answer: 2", "2", {}) == 0.0
    with pytest.raises(InvalidInput):
        math_fn("p", r"\boxed{1}", None, {})


# --------------------------------------------------------------------------- registry


def test_unknown_or_missing_rm_type_names_the_flag_and_known_names():
    with pytest.raises(ConfigError) as info:
        get_reward_fn("nope", None)
    assert "--rm-type" in str(info.value) and "'math'" in str(info.value) and "'deepscaler'" in str(info.value)
    assert info.value.flags == ("--rm-type",)
    with pytest.raises(ConfigError) as info:
        get_reward_fn(None, None)
    assert "--rm-type" in str(info.value) and "--custom-rm-path" in str(info.value)


def test_register_reward(monkeypatch):
    monkeypatch.setattr(rewards, "_REGISTRY", dict(rewards._REGISTRY))

    def copy_reward(prompt, response, label, metadata):
        return float(response == label)

    register_reward("copy-digits-test", copy_reward)
    register_reward("copy-digits-test", copy_reward)  # idempotent
    assert "copy-digits-test" in known_rewards()
    assert get_reward_fn("copy-digits-test", None)("p", "12", "12", {}) == 1.0
    with pytest.raises(InvalidInput, match="already registered"):
        register_reward("copy-digits-test", lambda prompt, response, label, metadata: 0.0)
    with pytest.raises(InvalidInput, match="must accept"):
        register_reward("two-args", lambda args, sample: 0.0)
    with pytest.raises(InvalidInput):
        register_reward("", copy_reward)


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """An importable module ``my_rewards`` with good and bad reward functions."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def length_reward(prompt, response, label, metadata):
            return len(response) / 10

        def miles_style(args, sample):
            return 1.0

        async def async_reward(prompt, response, label, metadata):
            return 1.0

        def returns_text(prompt, response, label, metadata):
            return "1.0"

        def returns_nan(prompt, response, label, metadata):
            return float("nan")

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_custom_rm_path_loads_and_wins_over_rm_type(reward_module):
    for spec in (f"{reward_module}:length_reward", f"{reward_module}.length_reward"):
        fn = get_reward_fn("math", spec)
        assert fn("p", "abcde", None, {}) == 0.5


@pytest.mark.parametrize("spec, match", [
    ("no_colon_or_dot", "module:function"),
    (":length_reward", "module:function"),
    ("my_rewards:", "module:function"),
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("my_rewards:missing", "has no attribute 'missing'"),
    ("my_rewards:miles_style", r"must accept \(prompt, response, label, metadata\)"),
    ("my_rewards:async_reward", r"an async reward has miles' form async def reward_func\(args, sample"),
    ("my_rewards:NOT_CALLABLE", "not callable"),
])
def test_custom_rm_path_errors_name_the_flag(reward_module, spec, match):
    with pytest.raises(ConfigError, match=match) as info:
        get_reward_fn(None, spec)
    assert "--custom-rm-path" in str(info.value) and info.value.flags == ("--custom-rm-path",)


@pytest.mark.parametrize("name", ["returns_text", "returns_nan"])
def test_non_numeric_rewards_fail_loudly(reward_module, name):
    fn = get_reward_fn(None, f"{reward_module}:{name}")
    with pytest.raises(RewardError, match=name):
        fn("p", "r", "l", {})
