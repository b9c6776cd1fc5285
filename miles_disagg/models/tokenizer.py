"""A checkpoint's tokenizer, without importing transformers where that changes nothing.

``transformers.AutoTokenizer`` costs about 5 CPU-seconds to import (it pulls in torch and
much of transformers); the ``tokenizers`` library it wraps loads the same ``tokenizer.json``
in a few milliseconds. :func:`load_tokenizer` returns a :class:`FastTokenizer` over
``tokenizers`` when the checkpoint's tokenizer is one that transformers would use unchanged
(see :func:`native_blocker`), and transformers' own tokenizer otherwise.

A :class:`FastTokenizer` implements what the rollout and the built-in engine call (calling it
on text, ``encode``, ``decode``, the special token ids, ``get_vocab``) with the same results
as transformers (a unit test compares them). Anything else, ``apply_chat_template`` included,
is served by transformers' tokenizer, loaded on first use: a user's hook that needs more of the
transformers API gets it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""``tokenizer_class`` values that mean "tokenizer.json as it is" (no class-specific setup)."""
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
OFF_BY_DEFAULT = ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces", "split_special_tokens")
MISTRAL_REGEX_VOCAB = 100_000  # transformers may patch the pre-tokenizer of vocabularies this large


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of ``model_dir``: a :class:`FastTokenizer` where it gives transformers'
    results, else ``transformers.AutoTokenizer.from_pretrained(model_dir)``."""
    model_dir = Path(model_dir)
    if native_blocker(model_dir) is None:
        return FastTokenizer(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def native_blocker(model_dir: Path) -> str | None:
    """Why transformers' tokenizer could differ from ``tokenizer.json`` used as it is (None: it cannot)."""
    config, spec = _read_json(model_dir / "tokenizer_config.json"), _read_json(model_dir / "tokenizer.json")
    if config is None or spec is None:
        return "no readable tokenizer_config.json and tokenizer.json"
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        return f"tokenizer_class {config.get('tokenizer_class')!r} has its own setup"
    switched_on = [key for key in OFF_BY_DEFAULT if config.get(key)]
    if switched_on:
        return f"tokenizer_config.json sets {switched_on}"
    if spec.get("truncation") or spec.get("padding"):
        return "tokenizer.json configures truncation or padding"
    known = _known_tokens(spec)
    missing = [token for token in _special_tokens(config) if token not in known]
    if missing:
        return f"special tokens {missing} are not in tokenizer.json (transformers would add them)"
    if len(known) > MISTRAL_REGEX_VOCAB:
        return "a vocabulary this large may get transformers' pre-tokenizer patch"
    return None


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(config: dict) -> list[str]:
    named = [_token_text(config.get(key)) for key in NAMED_SPECIAL]
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
    return [token for token in (*named, *map(_token_text, extra)) if token is not None]


def _known_tokens(spec: dict) -> set[str]:
    vocab = (spec.get("model") or {}).get("vocab") or {}
    known = set(vocab) if isinstance(vocab, dict) else {entry[0] for entry in vocab if entry}
    return known | {t.get("content") for t in spec.get("added_tokens") or [] if isinstance(t, dict)}


class FastTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library, with transformers' defaults (no
    truncation, no padding, special tokens kept unless asked). Other attributes come from
    transformers' tokenizer, loaded on first use."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        self.name_or_path = str(model_dir)
        self._tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        config = _read_json(Path(model_dir) / "tokenizer_config.json") or {}
        for key in NAMED_SPECIAL:
            token = _token_text(config.get(key))
            setattr(self, key, token)
            setattr(self, f"{key}_id", None if token is None else self._tokenizer.token_to_id(token))
        self._transformers = None

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **kwargs) -> Encoding:
        if kwargs:  # padding, tensors, truncation, ...: transformers' own
            return self.transformers(text, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            return _encoding_dict([self._tokenizer.encode(text, add_special_tokens=add_special_tokens)], single=True)
        return _encoding_dict(self._tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens),
                              single=False)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs:
            return self.transformers.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self.transformers.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            return self._tokenizer.token_to_id(tokens)
        return [self._tokenizer.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int]):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        return [self._tokenizer.id_to_token(i) for i in ids]

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def transformers(self):
        """transformers' tokenizer of the same checkpoint (imported and loaded on first use)."""
        if self._transformers is None:
            from transformers import AutoTokenizer

            self._transformers = AutoTokenizer.from_pretrained(self.name_or_path)
        return self._transformers

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_tokenizer", "_transformers"):
            raise AttributeError(name)
        return getattr(self.transformers, name)

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, vocab={len(self)})"


class Encoding(dict):
    """What calling the tokenizer returns: ``input_ids`` and ``attention_mask``, as keys and
    attributes (as transformers' ``BatchEncoding``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _encoding_dict(encodings: list, *, single: bool) -> Encoding:
    ids = [e.ids for e in encodings]
    mask = [e.attention_mask for e in encodings]
    return Encoding(input_ids=ids[0], attention_mask=mask[0]) if single else Encoding(input_ids=ids, attention_mask=mask)
