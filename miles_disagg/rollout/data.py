"""Prompt data: a JSONL file (``--prompt-data``) read once, served in resumable epochs.

Each line is a JSON object. ``--input-key`` holds the prompt, either a string or a chat
message list ``[{"role": ..., "content": ...}, ...]``; ``--label-key`` holds the label
(any JSON value); an optional metadata key holds a JSON object handed to the reward.
With ``--apply-chat-template`` the prompt is rendered once, at load, with the
tokenizer's chat template (a string prompt becomes one user message), so template
problems surface before anything starts. Blank lines are skipped. :func:`prompt_records`
streams the checked records of a file one at a time: the loader reads through it, and so does
preflight (every record, before anything starts; ``loop/preflight_checks.py``).

Order: epoch ``e`` visits every prompt once; with shuffling, in the order of a
permutation seeded by ``(seed, e)``, so the order depends only on the seed and the
epoch, never on how the batches were cut. :meth:`PromptDataset.state_dict` records
``(epoch, offset, seed)``; a dataset restored from it yields exactly the prompts the
original would have yielded next. One consumer at a time: not thread-safe.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from miles_disagg.types import ConfigError, InvalidInput

PROMPT_DATA_FLAG = "--prompt-data"
INPUT_KEY_FLAG = "--input-key"
LABEL_KEY_FLAG = "--label-key"
CHAT_TEMPLATE_FLAG = "--apply-chat-template"


@dataclass(frozen=True)
class Prompt:
    """One prompt: its record number in the file (0-based, blank lines not counted), text, label, metadata."""

    index: int
    text: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


class PromptDataset:
    """Prompts served in epochs, optionally reshuffled each epoch, with a resumable position."""

    def __init__(self, prompts: Sequence[Prompt], *, shuffle: bool = False, seed: int = 0):
        """``InvalidInput`` for an empty prompt list (an epoch would never end)."""
        if not prompts:
            raise InvalidInput("a prompt dataset needs at least one prompt")
        self._prompts = list(prompts)
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self._epoch = 0
        self._offset = 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_jsonl(
        cls,
        path: str | Path,
        input_key: str,
        label_key: str | None,
        *,
        apply_chat_template: bool,
        tokenizer: Any = None,
        shuffle: bool,
        seed: int,
        metadata_key: str | None = None,
    ) -> "PromptDataset":
        """Read and render every prompt of ``path``.

        ``ConfigError`` (naming the file, the line number and the flag) for a missing
        file, an empty file, a line that is not a JSON object, a missing input or label
        key, a malformed chat message list, a chat list without ``--apply-chat-template``,
        a metadata value that is not an object, or a template that fails to render.
        A line without the metadata key gets ``{}``; ``label_key=None`` reads no labels.
        """
        path = Path(path)
        if apply_chat_template and tokenizer is None:
            raise ConfigError(f"{CHAT_TEMPLATE_FLAG} needs a tokenizer to render {path}", flags=(CHAT_TEMPLATE_FLAG,))
        keys = RecordKeys(input_key, label_key, metadata_key)
        return cls(_read_prompts(path, keys, tokenizer if apply_chat_template else None), shuffle=shuffle, seed=seed)

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from."""
        return self._epoch

    def next_batch(self, num_prompts: int) -> list[Prompt]:
        """The next ``num_prompts`` prompts, continuing into the next epoch(s) when one ends."""
        if not isinstance(num_prompts, int) or num_prompts < 1:
            raise InvalidInput(f"next_batch needs a positive number of prompts, got {num_prompts!r}")
        batch: list[Prompt] = []
        while len(batch) < num_prompts:
            take = min(num_prompts - len(batch), len(self._order) - self._offset)
            batch.extend(self._prompts[i] for i in self._order[self._offset:self._offset + take])
            self._offset += take
            if self._offset == len(self._order):
                self._epoch, self._offset = self._epoch + 1, 0
                self._order = self._epoch_order(self._epoch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: ``epoch``, ``offset``, ``seed`` (plus checks of the data)."""
        return {"epoch": self._epoch, "offset": self._offset, "seed": self._seed,
                "shuffle": self._shuffle, "num_prompts": len(self._prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off; its seed replaces this dataset's seed.

        ``InvalidInput`` if the state is malformed, or was saved over a different number of
        prompts or a different shuffle setting (the order would not be the same one).
        """
        epoch, offset, seed = _require_ints(state, ("epoch", "offset", "seed"))
        if "num_prompts" in state and state["num_prompts"] != len(self._prompts):
            raise InvalidInput(f"data state was saved over {state['num_prompts']} prompts; "
                               f"this dataset has {len(self._prompts)}")
        if "shuffle" in state and bool(state["shuffle"]) != self._shuffle:
            raise InvalidInput(f"data state was saved with shuffle={state['shuffle']}; this dataset has "
                               f"shuffle={self._shuffle}")
        if epoch < 0 or not 0 <= offset < len(self._prompts):
            raise InvalidInput(f"data state position epoch={epoch} offset={offset} is out of range "
                               f"for {len(self._prompts)} prompts")
        self._seed, self._epoch, self._offset = seed, epoch, offset
        self._order = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        if self._shuffle:
            # A string seed hashes deterministically (str hashing is not salted by random.Random).
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order


def _require_ints(state: dict[str, Any], keys: tuple[str, ...]) -> list[int]:
    values = []
    for key in keys:
        value = state.get(key) if isinstance(state, dict) else None
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidInput(f"data state needs an integer {key!r}, got {state!r}")
        values.append(value)
    return values


MAX_LINE_BYTES = 16 * 1024 * 1024
"""A longer "line" is not a prompt record (a binary file, a wrong path); it is refused unread."""


@dataclass(frozen=True)
class RecordKeys:
    """Where a record keeps its parts: ``--input-key``, ``--label-key`` (None: no labels), the metadata key."""

    input_key: str
    label_key: str | None = None
    metadata_key: str | None = None


@dataclass(frozen=True)
class PromptRecord:
    """One checked record: its line number (1-based), the prompt as written (text, or chat messages), label, metadata."""

    line_number: int
    prompt: str | list[dict[str, str]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        """The prompt's own text (a chat list's contents, one after another), before any template."""
        return self.prompt if isinstance(self.prompt, str) else "".join(m["content"] for m in self.prompt)


def prompt_records(path: str | Path, keys: RecordKeys, *, apply_chat_template: bool, flag: str = PROMPT_DATA_FLAG,
                   max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[PromptRecord]:
    """Every non-blank line of ``path``, parsed and checked, one at a time (memory bounded by
    ``max_line_bytes``; nothing is kept): what :meth:`PromptDataset.from_jsonl` reads, less the
    chat template's rendering. ``ConfigError`` ``"{flag}: {path}:{line}: {what is wrong}"`` (naming
    ``flag`` and the key's flag) for the first bad line: longer than ``max_line_bytes``, not UTF-8,
    not a JSON object, a missing input or label key, an input that is neither text nor a well-formed
    chat message list, a chat list without ``--apply-chat-template``, metadata that is not an object.
    ``OSError`` when the file cannot be read (a missing file included)."""
    checker = _RecordChecker(Path(path), keys, apply_chat_template, flag)
    with Path(path).open("rb") as lines:
        line_number = 0
        while True:
            raw = lines.readline(max_line_bytes + 1)  # bounded: a file without newlines is not read whole
            line_number += 1
            if not raw:
                return
            if len(raw) > max_line_bytes:
                raise checker.fail(line_number, f"a line longer than {max_line_bytes} bytes")
            if raw.strip():
                yield checker.record(line_number, raw)


class _RecordChecker:
    """Turns one line into a :class:`PromptRecord`; every error names the flag, the file and the line."""

    def __init__(self, path: Path, keys: RecordKeys, apply_chat_template: bool, flag: str):
        self.path, self.keys, self.apply_chat_template, self.flag = path, keys, apply_chat_template, flag

    def fail(self, line_number: int, message: str, key_flag: str | None = None) -> ConfigError:
        flags = (self.flag.split()[0],) + ((key_flag,) if key_flag else ())
        return ConfigError(f"{self.flag}: {self.path}:{line_number}: {message}", flags=flags)

    def record(self, line_number: int, raw: bytes) -> PromptRecord:
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise self.fail(line_number, "not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise self.fail(line_number, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise self.fail(line_number, "JSON nested too deeply") from None
        if not isinstance(record, dict):
            raise self.fail(line_number, f"expected a JSON object, got {type(record).__name__}")
        keys = self.keys
        prompt = self._prompt(self._field(record, line_number, keys.input_key, INPUT_KEY_FLAG), line_number)
        label = None if keys.label_key is None else self._field(record, line_number, keys.label_key, LABEL_KEY_FLAG)
        return PromptRecord(line_number, prompt, label, self._metadata(record, line_number))

    def _field(self, record: dict, line_number: int, key: str, key_flag: str) -> Any:
        if key not in record:
            present = sorted(record)[:20]
            raise self.fail(line_number, f"missing key {key!r} ({key_flag}); keys present: {present}", key_flag)
        return record[key]

    def _metadata(self, record: dict, line_number: int) -> dict[str, Any]:
        key = self.keys.metadata_key
        if key is None or record.get(key) is None:
            return {}
        value = record[key]
        if not isinstance(value, dict):
            raise self.fail(line_number, f"metadata key {key!r} must hold a JSON object, got {type(value).__name__}")
        return value

    def _prompt(self, raw: Any, line_number: int) -> str | list[dict[str, str]]:
        key = self.keys.input_key
        if isinstance(raw, str):
            return raw
        if not isinstance(raw, list):
            raise self.fail(line_number, f"key {key!r} must hold a string or a chat message list, "
                                         f"got {type(raw).__name__}", INPUT_KEY_FLAG)
        if not raw:
            raise self.fail(line_number, f"key {key!r} holds an empty message list", INPUT_KEY_FLAG)
        for position, message in enumerate(raw):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise self.fail(line_number, f"message {position} of {key!r} must be "
                                             f"{{'role': str, 'content': str}}, got {message!r}", INPUT_KEY_FLAG)
        if not self.apply_chat_template:
            raise self.fail(line_number, f"key {key!r} holds chat messages; rendering them needs "
                                         f"{CHAT_TEMPLATE_FLAG}", CHAT_TEMPLATE_FLAG)
        return raw


def _read_prompts(path: Path, keys: RecordKeys, tokenizer: Any) -> list[Prompt]:
    """Every record of ``path`` as a prompt, rendered with ``tokenizer``'s chat template when one is given."""
    if not path.is_file():
        raise ConfigError(f"{PROMPT_DATA_FLAG} {str(path)!r} is not a file", flags=(PROMPT_DATA_FLAG,))
    prompts: list[Prompt] = []
    for record in prompt_records(path, keys, apply_chat_template=tokenizer is not None):
        text = record.prompt if tokenizer is None else _render(record, tokenizer, path)
        prompts.append(Prompt(index=len(prompts), text=text, label=record.label, metadata=record.metadata))
    if not prompts:
        raise ConfigError(f"{PROMPT_DATA_FLAG} {str(path)!r} holds no prompts", flags=(PROMPT_DATA_FLAG,))
    return prompts


def _render(record: PromptRecord, tokenizer: Any, path: Path) -> str:
    messages = [{"role": "user", "content": record.prompt}] if isinstance(record.prompt, str) else record.prompt
    where, flags = f"{PROMPT_DATA_FLAG}: {path}:{record.line_number}", (PROMPT_DATA_FLAG, CHAT_TEMPLATE_FLAG)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # tokenizers raise ValueError/TemplateError/...; all mean the same here
        raise ConfigError(f"{where}: the chat template failed: {exc}", flags=flags) from exc
    if not isinstance(text, str):
        raise ConfigError(f"{where}: the chat template returned {type(text).__name__}, not text", flags=flags)
    return text


def digit_run_prompts(num_prompts: int, digits: int, *, label: Any, seed: int) -> list[Prompt]:
    """``num_prompts`` runs of ``digits`` consecutive digits from random starts, each with ``label``."""
    rng = random.Random(seed)
    prompts = []
    for index in range(num_prompts):
        start = rng.randrange(10)
        text = "".join(str((start + i) % 10) for i in range(digits))
        prompts.append(Prompt(index=index, text=text, label=label))
    return prompts
