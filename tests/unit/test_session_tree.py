"""miles' trajectory tree and message matchers: where a replayed history attaches, one sample per branch
(token-exact, exactly-once loss masks, per-turn versions, staleness by the branch's oldest turn), and
each ``--session-message-matcher`` on messages as a harness replays them and on the rendered template."""

from __future__ import annotations

import pytest

from miles_disagg.rollout.sessions.agent import load_matcher
from miles_disagg.rollout.sessions.matchers import MatcherFailed, loose_tool_call, role_content_only, strict
from miles_disagg.rollout.sessions.templates import CHATML_TOOLS_TEMPLATE, render
from miles_disagg.rollout.sessions.tree import find_attach, leaves
from miles_disagg.rollout.sessions.types import SessionState, Turn, session_samples
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError

CALL = {"id": "call_1", "type": "function", "function": {"name": "count", "arguments": '{"from": 3, "to": 5}'}}
USER = {"role": "user", "content": "1"}


def _turn(prompt, out, start, end, finish="stop"):
    return Turn(tuple(prompt), tuple(out), tuple(-0.1 * (i + 1) for i in range(len(out))), start, end, finish)


def _assistant(text):
    return {"role": "assistant", "content": text}


def _forked_session() -> SessionState:
    """root a (v3) -> b (v3..4) -> c (v5); a retry of b's turn: b2 (v6), under a; a rewrite from scratch: r (v7)."""
    state = SessionState("s")
    a = state.record(_turn([1, 2], [3], 3, 3), _assistant("a"), [USER])
    b = state.record(_turn([1, 2, 3, 4], [5, 6], 3, 4), _assistant("b"), [{"role": "tool", "content": "t1"}], a)
    state.record(_turn([1, 2, 3, 4, 5, 6, 7], [8], 5, 5), _assistant("c"), [{"role": "tool", "content": "t2"}], b)
    state.record(_turn([1, 2, 3, 4], [9], 6, 6, "length"), _assistant("b2"), [{"role": "tool", "content": "t1"}], a)
    state.record(_turn([11, 12], [13], 7, 7), _assistant("r"), [{"role": "user", "content": "other"}], root=True)
    return state


def test_a_request_attaches_to_the_deepest_node_whose_whole_path_it_replays():
    state = _forked_session()
    nodes = state.nodes
    history = [USER, _assistant("a"), {"role": "tool", "content": "t1"}, _assistant("b"),
               {"role": "tool", "content": "t2"}, _assistant("c"), {"role": "tool", "content": "t3"}]
    point = find_attach(nodes, history, strict)
    assert (point.node.seq, point.matched) == (2, 6)  # continues c
    point = find_attach(nodes, history[:3] + [_assistant("edited")], strict)
    assert (point.node.seq, point.matched) == (0, 2)  # b rewritten: a branch under a
    twins = find_attach(nodes, history[:4] + [{"role": "tool", "content": "x"}], strict)
    assert twins.node.seq == 1
    assert find_attach(nodes, [{"role": "user", "content": "2"}], strict).node is None  # nothing matches: a new root
    assert find_attach(nodes, [{"role": "user", "content": "other"}, _assistant("r"), USER], strict).node.seq == 4


def test_each_branch_is_one_token_exact_sample_with_its_completions_trained_once():
    state = _forked_session()
    assert [leaf.seq for leaf in leaves(state.nodes)] == [2, 3, 4]
    first, retry, rewrite = session_samples(state, Sample(prompt="p", metadata={"task": "count"}))
    assert first.tokens == [1, 2, 3, 4, 5, 6, 7, 8] and first.loss_mask == [1, 0, 1, 1, 0, 1]
    assert first.call_versions == [[3, 3], [3, 4], [5, 5]] and first.weight_version_start == 3
    # the retry shares a's completion, which the first branch trains: its tokens are there, masked out
    assert retry.tokens == [1, 2, 3, 4, 9] and retry.loss_mask == [0, 0, 1]
    assert retry.response_logprobs == pytest.approx([-0.1, 0.0, -0.1])  # the engine's logprobs kept
    assert retry.call_versions == [[3, 3], [6, 6]] and retry.weight_version_start == 3  # oldest turn: a's
    assert retry.status == "truncated"
    assert rewrite.tokens == [11, 12, 13] and rewrite.loss_mask == [1] and rewrite.call_versions == [[7, 7]]
    trained = sorted(t for s in (first, retry, rewrite) for t, m in zip(s.response_ids, s.loss_mask) if m)
    assert trained == sorted(t for turn in state.turns for t in turn.output_ids)  # every completion, once
    for sample in (first, retry, rewrite):
        sample.check_consistent()
        assert sample.metadata["task"] == "count" and sample.metadata["session"]["num_branches"] == 3
    assert retry.metadata["session"]["branch"] == {"leaf": 3, "path": [0, 3]}
    assert first.metadata is not retry.metadata


TOOL_HISTORY = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "345"}]
REPLAYS = {  # how harnesses replay the stored assistant message, and which matchers take it as the same
    "verbatim": ({**TOOL_HISTORY[1]}, {"strict", "loose_tool_call", "role_content_only"}),
    "content None, tool-call index": ({"role": "assistant", "content": None,
                                        "tool_calls": [{**CALL, "index": 0}]},
                                       {"strict", "loose_tool_call", "role_content_only"}),
    "compact JSON arguments": ({"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "count", "arguments": '{"to":5,"from":3}'}}]},
        {"loose_tool_call", "role_content_only"}),
    "blank content beside calls": ({"role": "assistant", "content": "\n", "tool_calls": [
        {**CALL, "function": {"name": "count", "arguments": '{"to": 5, "from": 3}'}}]},
        {"loose_tool_call"}),
    "other argument value": ({"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "count", "arguments": '{"from": 3, "to": "5"}'}}]}, {"role_content_only"}),
    "other call id": ({"role": "assistant", "content": "", "tool_calls": [{**CALL, "id": "call_2"}]},
                      {"role_content_only"}),
    "reasoning dropped": ({**TOOL_HISTORY[1], "reasoning_content": "think"}, {"role_content_only"}),
}


@pytest.mark.parametrize("case", sorted(REPLAYS))
def test_each_matcher_takes_the_replays_miles_says_it_takes(case):
    replay, accepted = REPLAYS[case]
    stored = {**TOOL_HISTORY[1]} if case != "reasoning dropped" else replay
    replayed = replay if case != "reasoning dropped" else TOOL_HISTORY[1]
    for name, matcher in (("strict", strict), ("loose_tool_call", loose_tool_call),
                          ("role_content_only", role_content_only)):
        assert matcher(stored, replayed) is (name in accepted), (case, name)


def test_a_replay_a_matcher_accepts_renders_the_template_as_the_stored_history_where_strict_must():
    """strict accepts only what the template renders identically; loose_tool_call's equivalences change the
    rendered text (so the stored tokens, not the replay, stay authoritative: the tree keeps them)."""
    def rendered(message):
        return render(CHATML_TOOLS_TEMPLATE, [TOOL_HISTORY[0], message, TOOL_HISTORY[2]], add_generation_prompt=True)

    for case, (replay, accepted) in REPLAYS.items():
        if "strict" in accepted:
            assert rendered(replay) == rendered(TOOL_HISTORY[1]), case
    compact = REPLAYS["compact JSON arguments"][0]
    assert rendered(compact) != rendered(TOOL_HISTORY[1])
    state = SessionState("s")
    state.record(_turn([1], [2], 0, 0), TOOL_HISTORY[1], [TOOL_HISTORY[0]])
    replayed = [TOOL_HISTORY[0], compact, TOOL_HISTORY[2]]
    assert find_attach(state.nodes, replayed, strict).node is None  # strict: a new root (re-rendered)
    point = find_attach(state.nodes, replayed, loose_tool_call)
    assert point.node.seq == 0 and point.matched == 2  # loose: continues the stored tokens


def test_a_custom_matcher_is_imported_and_held_to_its_contract(tmp_path, monkeypatch):
    (tmp_path / "my_matchers.py").write_text(
        "def by_role(stored, replayed):\n    return stored['role'] == replayed['role']\n"
        "def truthy(stored, replayed):\n    return 1\n"
        "async def coroutine(stored, replayed):\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_matcher("my_matchers.by_role")(USER, {"role": "user", "content": "other"}) is True
    with pytest.raises(MatcherFailed, match="returned int"):
        load_matcher("my_matchers.truthy")(USER, USER)
    with pytest.raises(ConfigError, match="--session-message-matcher"):
        load_matcher("my_matchers.coroutine")
    with pytest.raises(ConfigError, match="--session-message-matcher"):
        load_matcher("my_matchers.missing")
