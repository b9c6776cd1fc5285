"""Preflight: how much of the prompt text the run's tokenizer cannot encode.

A tokenizer with an unknown token (a word- or character-level vocabulary, such as the demo's
``tiny-qwen3-digits``) turns every piece of text outside its vocabulary into that one id, without
a word: the policy then trains on prompts it cannot read. A byte-level tokenizer (Qwen's, most
released models') has no unknown token and encodes anything; it is not measured.

:class:`UnknownShare` counts, over the prompt text of a data file (the prompts as written, before
any chat template; at most :data:`MEASURED_CHARS` characters from the start of the file, so a
large file costs bounded time), the characters the tokenizer encodes as its unknown token. Most
of the text unknown (more than :data:`REFUSED_SHARE`) is a ``ConfigError``; any of it, a note.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from miles_disagg.types import ConfigError

REFUSED_SHARE = 0.5  # more than this share of the text unknown: refused (most of the prompt would be one id)
MEASURED_CHARS = 1_000_000  # prompt text measured per file, from its start
SHOWN_UNKNOWN = 5  # the most frequent unknown characters named in the message


@dataclass(frozen=True)
class Vocabulary:
    """What the run's tokenizer can encode: its name for messages, what to do when it does not fit,
    and ``unknown(text)``: the pieces of ``text`` it encodes as its unknown token."""

    name: str
    advice: str
    unknown: Callable[[str], list[str]]


@dataclass
class UnknownShare:
    """The unknown share of the prompt text of one data file (see the module docstring)."""

    vocabulary: Vocabulary
    measured_chars: int = 0
    unknown_chars: int = 0
    measured_records: int = 0
    records: int = 0
    examples: Counter = field(default_factory=Counter)

    def add(self, text: str) -> None:
        """One record's prompt text (records past :data:`MEASURED_CHARS` are counted, not measured)."""
        self.records += 1
        if self.measured_chars >= MEASURED_CHARS:
            return
        pieces = self.vocabulary.unknown(text)
        self.measured_records += 1
        self.measured_chars += len(text)
        self.unknown_chars += sum(len(piece) for piece in pieces)
        self.examples.update(ch for piece in pieces for ch in piece)

    @property
    def share(self) -> float:
        return self.unknown_chars / self.measured_chars if self.measured_chars else 0.0

    def verdict(self, flag: str) -> str | None:
        """None when every character is known; the note to show when some are not; ``ConfigError``
        (naming ``flag``, the tokenizer, the share and what to do) when most are not."""
        if not self.unknown_chars:
            return None
        shown = ", ".join(repr(ch) for ch, _ in self.examples.most_common(SHOWN_UNKNOWN))
        measured = "" if self.measured_records == self.records else \
            f", measured over the first {self.measured_records} of {self.records} records"
        found = (f"{flag}: {self.share:.1%} of the prompt text ({self.unknown_chars} of {self.measured_chars} "
                 f"characters{measured}; most often {shown}) is not in the vocabulary of {self.vocabulary.name}: "
                 "each such piece becomes the one unknown token")
        if self.share > REFUSED_SHARE:
            raise ConfigError(f"{found}; {self.vocabulary.advice}", (flag.split()[0], "--hf-checkpoint"))
        return found


def run_vocabulary(hf_checkpoint: str | None, made_by_init: tuple[str, str] | None) -> Vocabulary | None:
    """The vocabulary of the tokenizer a run will use: the ``hf_checkpoint`` directory's
    ``tokenizer.json``, or, where that directory is still to be made, the tiny model's character
    set (``made_by_init``: the ``--hf-checkpoint-init`` name and its characters). None when the
    tokenizer has no unknown token (nothing can be unknown) or cannot be read here (the run's own
    loading of it says why, later)."""
    if not hf_checkpoint:
        return None
    path = Path(hf_checkpoint)
    if path.is_dir():
        return _checkpoint_vocabulary(path)
    if made_by_init is not None:
        init, charset = made_by_init
        name = f"the {init} tokenizer --hf-checkpoint-init makes (characters {charset!r})"
        return Vocabulary(name, _advice(charset), lambda text: [ch for ch in text if ch not in charset])
    return None


def _checkpoint_vocabulary(path: Path) -> Vocabulary | None:
    spec_path = path / "tokenizer.json"
    try:
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
        unknown_token = _unknown_token(spec.get("model") or {})
        if unknown_token is None:
            return None
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(spec_path))
    except Exception:  # noqa: BLE001 - unreadable or unusual here: not measured, the run's own loading decides
        return None
    unknown_id = tokenizer.token_to_id(unknown_token)
    if unknown_id is None:
        return None

    def unknown(text: str) -> list[str]:
        encoding = tokenizer.encode(text, add_special_tokens=False)
        pieces = (text[start:end] for token, (start, end) in zip(encoding.ids, encoding.offsets) if token == unknown_id)
        return [piece for piece in pieces if piece and piece != unknown_token]  # the token itself, written out, is known

    from miles_disagg.models.tiny_qwen3 import charset_name, read_init_record

    made = read_init_record(path)
    charset = made.get("charset") if made else None
    if isinstance(charset, str):
        name = (f"the tokenizer of --hf-checkpoint {path} (a tiny-qwen3 of the {charset_name(charset)} charset: "
                f"characters {charset!r})")
        return Vocabulary(name, _advice(charset), unknown)
    return Vocabulary(f"the tokenizer of --hf-checkpoint {path} (unknown token {unknown_token!r})",
                      "use a --hf-checkpoint whose tokenizer covers the prompts' text", unknown)


def _unknown_token(model: dict) -> str | None:
    """The unknown token of a ``tokenizer.json`` model (WordLevel, WordPiece, BPE: ``unk_token``;
    Unigram: the vocabulary entry at ``unk_id``); None when it has none."""
    token = model.get("unk_token")
    if isinstance(token, str) and token:
        return token
    unk_id, vocab = model.get("unk_id"), model.get("vocab")
    if isinstance(unk_id, int) and isinstance(vocab, list) and 0 <= unk_id < len(vocab) and vocab[unk_id]:
        return str(vocab[unk_id][0])
    return None


def _advice(charset: str) -> str:
    from miles_disagg.models.tiny_qwen3 import CHARSETS

    if set(CHARSETS["full"]) > set(charset):
        return ("train a model whose tokenizer covers the text: --hf-checkpoint-init tiny-qwen3 --hf-checkpoint NEW_DIR "
                "makes a tiny one with letters, digits and punctuation (or give a real checkpoint), or write the "
                "prompts in its characters")
    return "use a --hf-checkpoint whose tokenizer covers the prompts' text (a real model's checkpoint)"
