"""TITO (tokens in, tokens out) on rendered chat templates: each family's merge rule (system prompts,
tools, tool calls, reasoning blocks), the append-role and history checks, the prefix check's failure,
and a finished session as one training sample (loss mask, logprobs, versions per turn)."""

from __future__ import annotations

import pytest

from miles_disagg.models.tokenizer import load_tokenizer
from miles_disagg.rollout.sessions.chat import assistant_message, parse_chat_request
from miles_disagg.rollout.sessions.streaming import ContentDeltas
from miles_disagg.rollout.sessions.templates import CHATML_TOOLS_TEMPLATE, checkpoint_template, render
from miles_disagg.config.session_rules import check_matcher, check_tito_model
from miles_disagg.rollout.sessions.tito import AppendRoleRefused, TitoRule
from miles_disagg.rollout.sessions.types import PrefixMismatch, SessionState, Turn, session_samples, token_drift
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError, InvalidInput

TOOLS = [{"type": "function", "function": {"name": "count", "parameters": {"type": "object"}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "count", "arguments": '{"from": 3}'}}


@pytest.fixture(scope="module")
def encode(tiny_qwen3_dir):
    tokenizer = load_tokenizer(tiny_qwen3_dir)
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def _rule(encode, model="qwen3", roles=("tool", "user")) -> TitoRule:
    return TitoRule.make(model, CHATML_TOOLS_TEMPLATE, encode, roles)


@pytest.mark.parametrize("system", [None, "You count."])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_qwen3_merge_of_a_tool_turn_equals_the_template_rendering_of_the_whole_conversation(encode, system, tools):
    rule = _rule(encode)
    first = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "345"}]
    prompt = rule.first_prompt(first, tools)
    assert prompt == encode(render(CHATML_TOOLS_TEMPLATE, first, tools=tools, add_generation_prompt=True))
    generated = encode('67\n<tool_call>\n{"name": "count", "arguments": {"from": 3}}\n</tool_call><|im_end|>')
    assistant = {"role": "assistant", "content": "67", "tool_calls": [CALL]}
    appended = [{"role": "tool", "tool_call_id": "call_1", "content": "89"}, {"role": "user", "content": "go on"}]
    merged = rule.merge(prompt + generated, rule.appended_ids(appended, tools))
    whole = render(CHATML_TOOLS_TEMPLATE, first + [assistant] + appended, tools=tools, add_generation_prompt=True)
    assert merged == encode(whole)  # the newline after <|im_end|> is the Qwen3 rule's
    assert merged[:len(prompt) + len(generated)] == prompt + generated


def test_reasoning_blocks_stay_as_generated_where_a_rerender_would_drop_them(encode):
    rule = _rule(encode)
    first = [{"role": "user", "content": "1"}]
    prompt = rule.first_prompt(first, None)
    generated = encode("<think>\nup\n</think>\n\n2<|im_end|>")
    appended = [{"role": "user", "content": "3"}]
    merged = rule.merge(prompt + generated, rule.appended_ids(appended, None))
    assert merged[:len(prompt) + len(generated)] == prompt + generated  # token-exact: what the model generated
    rerendered = encode(render(CHATML_TOOLS_TEMPLATE, first + [{"role": "assistant", "content": "<think>\nup\n</think>"
                                                                "\n\n2"}] + appended, add_generation_prompt=True))
    assert rerendered != merged and len(rerendered) < len(merged)  # the template drops history's reasoning


def test_the_default_rule_concatenates_and_adds_no_boundary_token(encode):
    default, qwen3 = _rule(encode, "default"), _rule(encode)
    stored = encode("<|im_start|>user\n1<|im_end|>\n<|im_start|>assistant\n2<|im_end|>")
    appended = default.appended_ids([{"role": "tool", "content": "3"}], None)
    assert default.merge(stored, appended) == stored + appended
    assert qwen3.merge(stored, appended) == stored + encode("\n") + appended
    assert qwen3.merge(stored[:-1], appended) == stored[:-1] + appended  # cut by length: no <|im_end|>, no newline


def test_appended_roles_are_limited_to_the_allowed_ones_and_tool_is_always_allowed(encode):
    only_tool = _rule(encode, roles=())
    only_tool.appended_ids([{"role": "tool", "content": "1"}], None)
    with pytest.raises(AppendRoleRefused, match="'user'"):
        only_tool.appended_ids([{"role": "user", "content": "1"}], None)
    with pytest.raises(ConfigError, match="--tito-allowed-append-roles"):
        _rule(encode, roles=("assistant",))


def test_miles_families_not_implemented_are_refused_with_one_line_and_matchers_are_miles():
    assert check_tito_model("qwen3") == "qwen3"
    with pytest.raises(ConfigError, match="--tito-model glm47 is a miles flag that does not apply here"):
        check_tito_model("glm47")
    for name in ("strict", "loose_tool_call", "role_content_only", "my_pkg.matchers.same"):
        assert check_matcher(name) == name
    for bad in ("loose", "a..b", "pkg.mod-ule.f"):
        with pytest.raises(ConfigError, match="--session-message-matcher"):
            check_matcher(bad)


def _turn(prompt, out, start, end, finish="stop"):
    return Turn(tuple(prompt), tuple(out), tuple(-0.1 * (i + 1) for i in range(len(out))), start, end, finish)


def test_the_prefix_check_fails_on_a_prompt_that_does_not_extend_the_stored_ids():
    state = SessionState("s")
    state.record(_turn([1, 2, 3], [4, 5], 3, 3), {"role": "assistant", "content": "x"}, [])
    state.check_prefix([1, 2, 3, 4, 5, 9])
    with pytest.raises(PrefixMismatch, match="token drift at position 3"):
        state.check_prefix([1, 2, 3, 7, 5, 9])
    with pytest.raises(PrefixMismatch):
        state.record(_turn([1, 2], [4], 3, 3), {"role": "assistant", "content": "y"}, [], state.nodes[0])
    assert len(state.turns) == 1  # nothing recorded


def test_a_finished_session_is_one_sample_trained_on_generated_tokens_only():
    state = SessionState("s")
    state.record(_turn([1, 2, 3], [4, 5], 3, 3), {"role": "assistant", "content": "a"}, [])
    state.record(_turn([1, 2, 3, 4, 5, 6, 7], [8], 3, 4), {"role": "assistant", "content": "b"}, [])
    state.record(_turn([1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], 5, 5, "length"), {"role": "assistant", "content": "c"}, [])
    assert token_drift(state.turns) == 0
    [sample] = session_samples(state, Sample(prompt="p"))
    assert sample.prompt_ids == [1, 2, 3] and sample.response_ids == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sample.loss_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert sample.response_logprobs == pytest.approx([-0.1, -0.2, 0, 0, -0.1, 0, -0.1, -0.2])
    assert sample.call_versions == [[3, 3], [3, 4], [5, 5]]
    assert (sample.weight_version_start, sample.weight_version_end) == (3, 5)  # staleness: the oldest turn
    assert sample.status == "truncated" and sample.metadata["session"]["num_turns"] == 3
    sample.check_consistent()
    broken = SessionState("b", broken="drift")
    with pytest.raises(InvalidInput, match="broke"):
        session_samples(broken, Sample())
    with pytest.raises(InvalidInput, match="no turns"):
        session_samples(SessionState("e"), Sample())


def test_token_drift_counts_turns_whose_prompt_does_not_continue_the_last():
    turns = [_turn([1, 2], [3], 0, 0), _turn([1, 2, 3, 4], [5], 0, 0), _turn([1, 2, 9, 4, 5], [6], 0, 0)]
    assert token_drift(turns) == 1


def test_tool_calls_are_parsed_out_of_the_completion_and_content_is_streamed_as_a_prefix():
    message, finish = assistant_message('ok\n<tool_call>\n{"name": "count", "arguments": {"from": 3}}\n</tool_call>')
    assert finish == "tool_calls" and message["content"] == "ok"
    assert message["tool_calls"][0]["function"] == {"name": "count", "arguments": '{"from": 3}'}
    assert assistant_message("<tool_call>{not json}</tool_call>") == (
        {"role": "assistant", "content": "<tool_call>{not json}</tool_call>"}, "")
    for text, calls in (('ok\n<tool_call>\n{"name": "count", "arguments": {}}\n</tool_call>', True),
                        ("plain\n\ntext", False), ("<tool_call>{not json}</tool_call>", False), ("é", False)):
        deltas, sent = ContentDeltas(), ""
        ids = text.encode()
        for end in range(1, len(ids) + 1):  # the text as decoded token by token (bytes here)
            sent += deltas.next(ids[:end].decode(errors="replace"))
        content = assistant_message(text)[0]["content"]
        assert content.startswith(sent) and sent + deltas.rest(content) == content, text
        assert ("<tool" not in sent) and (calls or not text.startswith("<") or sent == "")


def test_chat_bodies_are_checked():
    assert parse_chat_request({"messages": [{"role": "user", "content": "1"}], "max_tokens": 4}).max_tokens == 4
    for bad, field in (({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "1"}]}, "role"),
                       ({"messages": [{"role": "user", "content": "1"}], "n": 2}, "n=2"),
                       ({"messages": [{"role": "user", "content": "1"}], "temperature": "hot"}, "temperature")):
        with pytest.raises(InvalidInput, match=field):
            parse_chat_request(bad)


def test_a_checkpoint_without_a_template_gets_the_chatml_one(tiny_qwen3_dir, tmp_path):
    assert checkpoint_template(tiny_qwen3_dir) == CHATML_TOOLS_TEMPLATE
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    assert checkpoint_template(tiny_qwen3_dir, tmp_path / "t.jinja") == "{{ messages[0].content }}"
    with pytest.raises(ConfigError, match="--chat-template-path"):
        checkpoint_template(tiny_qwen3_dir, tmp_path / "missing.jinja")


def test_miles_session_server_versions_v2_is_this_endpoint_and_v1_is_refused_with_one_line():
    from miles_disagg.config.session_rules import session_server_argv

    assert session_server_argv(["--use-session-server", "v2", "--tito-model", "qwen3"]) == [
        "--use-session-server", "--tito-model", "qwen3"]
    assert session_server_argv(["--use-session-server", "--x"]) == ["--use-session-server", "--x"]
    with pytest.raises(ConfigError, match="--use-session-server v1 is a miles flag that does not apply here"):
        session_server_argv(["--use-session-server", "v1"])
