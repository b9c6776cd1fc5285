"""``models.tokenizer``: the fast path gives transformers' results, and is taken only where it can."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from miles_disagg.models.tokenizer import FastTokenizer, load_tokenizer, native_blocker
from miles_disagg.models.tiny_qwen3 import CHARSET, DIGITS_CHARSET, build_tokenizer


def _saved(tmp_path: Path, name: str, charset: str = CHARSET) -> Path:
    path = tmp_path / name
    build_tokenizer(charset).save_pretrained(path)
    return path


def _byte_level_bpe(tmp_path: Path) -> Path:
    """A byte-level BPE with a BOS-adding post-processor, saved the generic way."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(["the quick brown fox jumps over the lazy dog", "count 1 2 3 4 5 6 7 8 9"] * 20, trainer)
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = tmp_path / "bpe"
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(path)
    return path


def _texts(charset: str, n: int = 200) -> list[str]:
    rng = random.Random(7)
    alphabet = charset + "é∑"  # characters outside the vocabulary too
    texts = ["", " ", "<|im_start|>user\n12<|im_end|>", "<|endoftext|>3"]
    return texts + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.mark.parametrize("which", ["full", "digits", "bpe"])
def test_the_fast_path_encodes_and_decodes_as_transformers(tmp_path: Path, which: str) -> None:
    from transformers import AutoTokenizer

    charset = {"full": CHARSET, "digits": DIGITS_CHARSET, "bpe": CHARSET}[which]
    path = _byte_level_bpe(tmp_path) if which == "bpe" else _saved(tmp_path, which, charset)
    fast, reference = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert isinstance(fast, FastTokenizer)
    texts = _texts(charset)
    for text in texts:
        for special in (True, False):
            assert fast(text, add_special_tokens=special)["input_ids"] == \
                reference(text, add_special_tokens=special)["input_ids"], text
            assert fast.encode(text, add_special_tokens=special) == reference.encode(text, add_special_tokens=special)
    assert fast(texts[:5]).input_ids == reference(texts[:5]).input_ids
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.randrange(len(reference)) for _ in range(rng.randint(0, 12))]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), ids
    assert fast.get_vocab() == reference.get_vocab() and len(fast) == len(reference)
    for key in ("eos_token_id", "pad_token_id", "bos_token_id", "eos_token", "pad_token", "bos_token"):
        assert getattr(fast, key) == getattr(reference, key), key


def test_anything_else_is_served_by_transformers_tokenizer(tmp_path: Path) -> None:
    path = _saved(tmp_path, "digits", DIGITS_CHARSET)
    fast = load_tokenizer(path)
    assert fast.batch_decode([[3, 4], [5]]) == [fast.decode([3, 4]), fast.decode([5])]
    assert fast("12", return_attention_mask=False)["input_ids"] == fast("12")["input_ids"]
    assert fast.transformers.name_or_path == str(path)


def _with_config(path: Path, **changes) -> Path:
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("changes, reason", [
    ({"tokenizer_class": "Qwen2Tokenizer"}, "has its own setup"),
    ({"add_bos_token": True}, "add_bos_token"),
    ({"clean_up_tokenization_spaces": True}, "clean_up_tokenization_spaces"),
    ({"extra_special_tokens": ["<|not-there|>"]}, "not in tokenizer.json"),
])
def test_a_tokenizer_transformers_would_change_is_transformers(tmp_path: Path, changes: dict, reason: str) -> None:
    path = _with_config(_saved(tmp_path, "digits", DIGITS_CHARSET), **changes)
    assert reason in native_blocker(path)
    assert not isinstance(load_tokenizer(path), FastTokenizer)


def test_a_directory_without_tokenizer_files_is_transformers_to_judge(tmp_path: Path) -> None:
    assert "no readable" in native_blocker(tmp_path)
    with pytest.raises(Exception):  # transformers' own error for a directory without a tokenizer
        load_tokenizer(tmp_path)
