"""Prompt JSONL loading, chat rendering, epochs, per-epoch shuffling and resumable position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_disagg.rollout.data import Prompt, PromptDataset
from miles_disagg.types import ConfigError, InvalidInput


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def numbered(tmp_path: Path, n: int) -> Path:
    return write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "label": str(i)} for i in range(n)])


def load(path: Path, **kwargs) -> PromptDataset:
    options = {"apply_chat_template": False, "shuffle": False, "seed": 0}
    options.update(kwargs)
    return PromptDataset.from_jsonl(path, "prompt", "label", **options)


class FakeTokenizer:
    """Records the calls and renders messages as ``role: content`` lines plus a generation cue."""

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        self.calls.append((messages, tokenize, add_generation_prompt))
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


# --------------------------------------------------------------------------- loading


def test_reads_prompts_labels_metadata_and_skips_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"question": "1+1?", "answer": 2, "extra": {"level": 1}},
        "   ",
        {"question": "2+2?", "answer": "4"},
        {"question": "3+3?", "answer": [6, "six"], "extra": None},
    ])
    data = PromptDataset.from_jsonl(path, "question", "answer", apply_chat_template=False,
                                    shuffle=False, seed=0, metadata_key="extra")
    assert len(data) == 3
    assert data.next_batch(3) == [
        Prompt(0, "1+1?", 2, {"level": 1}),
        Prompt(1, "2+2?", "4", {}),
        Prompt(2, "3+3?", [6, "six"], {}),
    ]


def test_label_key_none_reads_no_labels(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}])
    data = PromptDataset.from_jsonl(path, "prompt", None, apply_chat_template=False, shuffle=False, seed=0)
    assert data.next_batch(1)[0].label is None


def test_chat_template_renders_strings_and_message_lists(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "plain", "label": 1}, {"prompt": chat, "label": 2}])
    tokenizer = FakeTokenizer()
    data = load(path, apply_chat_template=True, tokenizer=tokenizer)
    first, second = data.next_batch(2)
    assert first.text == "user: plain\nassistant:"
    assert second.text == "system: be brief\nuser: hi\nassistant:"
    assert [call[1:] for call in tokenizer.calls] == [(False, True), (False, True)]


def test_chat_template_with_a_real_tokenizer(tmp_path):
    from miles_disagg.models.tiny_qwen3 import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    data = load(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2+2?", "label": 4}]),
                apply_chat_template=True, tokenizer=tokenizer)
    assert data.next_batch(1)[0].text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_template_failure_names_line_and_flag(tmp_path):
    from miles_disagg.models.tiny_qwen3 import build_tokenizer  # has no chat template

    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "label": 1}])
    with pytest.raises(ConfigError, match=r"d\.jsonl:1: the chat template failed") as info:
        load(path, apply_chat_template=True, tokenizer=build_tokenizer())
    assert "--apply-chat-template" in info.value.flags


def test_chat_template_without_tokenizer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--apply-chat-template needs a tokenizer"):
        load(numbered(tmp_path, 2), apply_chat_template=True)


@pytest.mark.parametrize("line, match", [
    ("{not json", r"bad\.jsonl:2: not valid JSON"),
    ('["a list"]', r"bad\.jsonl:2: expected a JSON object, got list"),
    ('{"label": 1}', r"bad\.jsonl:2: missing key 'prompt' \(--input-key\); keys present: \['label'\]"),
    ('{"prompt": "x"}', r"bad\.jsonl:2: missing key 'label' \(--label-key\)"),
    ('{"prompt": 5, "label": 1}', r"bad\.jsonl:2: key 'prompt' must hold a string or a chat message list"),
    ('{"prompt": [], "label": 1}', r"bad\.jsonl:2: key 'prompt' holds an empty message list"),
    ('{"prompt": [{"role": "user"}], "label": 1}', r"bad\.jsonl:2: message 0 of 'prompt' must be"),
    ('{"prompt": [{"role": "user", "content": "x"}], "label": 1}', r"bad\.jsonl:2: .*needs --apply-chat-template"),
    ('{"prompt": "x", "label": 1, "meta": [1]}', r"bad\.jsonl:2: metadata key 'meta' must hold a JSON object"),
])
def test_bad_lines_name_file_line_and_problem(tmp_path, line, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "label": 0}, line])
    with pytest.raises(ConfigError, match=match) as info:
        PromptDataset.from_jsonl(path, "prompt", "label", apply_chat_template=False, shuffle=False, seed=0,
                                 metadata_key="meta")
    assert "--prompt-data" in info.value.flags


def test_missing_and_empty_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        load(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ConfigError, match="holds no prompts"):
        load(tmp_path / "empty.jsonl")


# --------------------------------------------------------------------------- epochs and order


def indices(batch: list[Prompt]) -> list[int]:
    return [p.index for p in batch]


def test_unshuffled_batches_wrap_across_epochs(tmp_path):
    data = load(numbered(tmp_path, 5))
    assert indices(data.next_batch(3)) == [0, 1, 2]
    assert data.epoch == 0
    assert indices(data.next_batch(3)) == [3, 4, 0]
    assert data.epoch == 1
    assert indices(data.next_batch(12)) == [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]
    assert data.epoch == 3
    with pytest.raises(InvalidInput):
        data.next_batch(0)


def test_shuffle_is_a_seeded_permutation_per_epoch(tmp_path):
    path = numbered(tmp_path, 20)
    a, b, other_seed = load(path, shuffle=True, seed=7), load(path, shuffle=True, seed=7), load(path, shuffle=True, seed=8)
    epoch0, epoch1 = indices(a.next_batch(20)), indices(a.next_batch(20))
    assert sorted(epoch0) == sorted(epoch1) == list(range(20))
    assert epoch0 != epoch1 and epoch0 != list(range(20))
    # the order depends on the seed and the epoch only, not on how batches are cut
    assert indices(b.next_batch(7) + b.next_batch(13) + b.next_batch(20)) == epoch0 + epoch1
    assert indices(other_seed.next_batch(20)) != epoch0


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_continues_at_the_same_place(tmp_path, shuffle):
    path = numbered(tmp_path, 9)
    original = load(path, shuffle=shuffle, seed=3)
    original.next_batch(13)
    state = json.loads(json.dumps(original.state_dict()))  # survives a JSON round trip
    assert state == {"epoch": 1, "offset": 4, "seed": 3, "shuffle": shuffle, "num_prompts": 9}
    resumed = load(path, shuffle=shuffle, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    assert indices(resumed.next_batch(20)) == indices(original.next_batch(20))
    assert resumed.state_dict() == original.state_dict()


@pytest.mark.parametrize("change, match", [
    ({"num_prompts": 10}, "saved over 10 prompts"),
    ({"shuffle": False}, "shuffle=False"),
    ({"offset": 9}, "out of range"),
    ({"epoch": -1}, "out of range"),
    ({"seed": "3"}, "integer 'seed'"),
])
def test_load_state_dict_refuses_a_state_from_other_data(tmp_path, change, match):
    data = load(numbered(tmp_path, 9), shuffle=True, seed=3)
    with pytest.raises(InvalidInput, match=match):
        data.load_state_dict({**data.state_dict(), **change})
    assert data.state_dict()["offset"] == 0  # nothing changed


def test_constructor_from_prompts_and_empty_refused():
    data = PromptDataset([Prompt(0, "a"), Prompt(1, "b")])
    assert [p.text for p in data.next_batch(3)] == ["a", "b", "a"]
    with pytest.raises(InvalidInput):
        PromptDataset([])
