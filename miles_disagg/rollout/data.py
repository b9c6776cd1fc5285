"""Prompt data: a JSONL file (``--prompt-data``) read once, served in resumable epochs.

Each line is a JSON object. ``--input-key`` holds the prompt, either a string or a chat
message list ``[{"role": ..., "content": ...}, ...]``; ``--label-key`` holds the label
(any JSON value); an optional metadata key holds a JSON object handed to the reward.
With ``--apply-chat-template`` the prompt is rendered once, at load, with the
tokenizer's chat template (a string prompt becomes one user message), so template
problems surface before anything starts. Blank lines are skipped.

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
from typing import Any, Sequence

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
        reader = _RecordReader(path, input_key, label_key, metadata_key, tokenizer if apply_chat_template else None)
        return cls(reader.read_all(), shuffle=shuffle, seed=seed)

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


class _RecordReader:
    """Turns the lines of one JSONL file into prompts; every error names the file and line."""

    def __init__(self, path: Path, input_key: str, label_key: str | None, metadata_key: str | None, tokenizer: Any):
        self.path, self.input_key, self.label_key = path, input_key, label_key
        self.metadata_key, self.tokenizer = metadata_key, tokenizer

    def read_all(self) -> list[Prompt]:
        if not self.path.is_file():
            raise ConfigError(f"{PROMPT_DATA_FLAG} {str(self.path)!r} is not a file", flags=(PROMPT_DATA_FLAG,))
        prompts: list[Prompt] = []
        with self.path.open(encoding="utf-8") as lines:
            for line_number, line in enumerate(lines, start=1):
                if line.strip():
                    prompts.append(self._prompt(len(prompts), line_number, line))
        if not prompts:
            raise ConfigError(f"{PROMPT_DATA_FLAG} {str(self.path)!r} holds no prompts", flags=(PROMPT_DATA_FLAG,))
        return prompts

    def _fail(self, line_number: int, message: str, flag: str = PROMPT_DATA_FLAG) -> ConfigError:
        flags = (PROMPT_DATA_FLAG,) if flag == PROMPT_DATA_FLAG else (PROMPT_DATA_FLAG, flag)
        return ConfigError(f"{self.path}:{line_number}: {message}", flags=flags)

    def _prompt(self, index: int, line_number: int, line: str) -> Prompt:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise self._fail(line_number, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise self._fail(line_number, f"expected a JSON object, got {type(record).__name__}")
        raw_input = self._field(record, line_number, self.input_key, INPUT_KEY_FLAG)
        label = None if self.label_key is None else self._field(record, line_number, self.label_key, LABEL_KEY_FLAG)
        return Prompt(index=index, text=self._render(raw_input, line_number), label=label,
                      metadata=self._metadata(record, line_number))

    def _field(self, record: dict, line_number: int, key: str, flag: str) -> Any:
        if key not in record:
            raise self._fail(line_number, f"missing key {key!r} ({flag}); keys present: {sorted(record)}", flag)
        return record[key]

    def _metadata(self, record: dict, line_number: int) -> dict[str, Any]:
        if self.metadata_key is None or record.get(self.metadata_key) is None:
            return {}
        value = record[self.metadata_key]
        if not isinstance(value, dict):
            raise self._fail(line_number, f"metadata key {self.metadata_key!r} must hold a JSON object, "
                                          f"got {type(value).__name__}")
        return value

    def _render(self, raw_input: Any, line_number: int) -> str:
        if isinstance(raw_input, str):
            messages = [{"role": "user", "content": raw_input}]
        elif isinstance(raw_input, list):
            messages = self._messages(raw_input, line_number)
        else:
            raise self._fail(line_number, f"key {self.input_key!r} must hold a string or a chat message list, "
                                          f"got {type(raw_input).__name__}", INPUT_KEY_FLAG)
        if self.tokenizer is None:
            if isinstance(raw_input, str):
                return raw_input
            raise self._fail(line_number, f"key {self.input_key!r} holds chat messages; rendering them needs "
                                          f"{CHAT_TEMPLATE_FLAG}", CHAT_TEMPLATE_FLAG)
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # tokenizers raise ValueError/TemplateError/...; all mean the same here
            raise self._fail(line_number, f"the chat template failed: {exc}", CHAT_TEMPLATE_FLAG) from exc
        if not isinstance(text, str):
            raise self._fail(line_number, f"the chat template returned {type(text).__name__}, not text",
                             CHAT_TEMPLATE_FLAG)
        return text

    def _messages(self, raw: list, line_number: int) -> list[dict[str, str]]:
        if not raw:
            raise self._fail(line_number, f"key {self.input_key!r} holds an empty message list", INPUT_KEY_FLAG)
        for position, message in enumerate(raw):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise self._fail(line_number, f"message {position} of {self.input_key!r} must be "
                                              f"{{'role': str, 'content': str}}, got {message!r}", INPUT_KEY_FLAG)
        return raw


def digit_run_prompts(num_prompts: int, digits: int, *, label: Any, seed: int) -> list[Prompt]:
    """``num_prompts`` runs of ``digits`` consecutive digits from random starts, each with ``label``."""
    rng = random.Random(seed)
    prompts = []
    for index in range(num_prompts):
        start = rng.randrange(10)
        text = "".join(str((start + i) % 10) for i in range(digits))
        prompts.append(Prompt(index=index, text=text, label=label))
    return prompts
