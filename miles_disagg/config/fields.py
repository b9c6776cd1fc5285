"""Declare a config field once; the command-line flag is derived from it.

Each component config is a keyword-only dataclass whose fields are made with
:func:`flag`. The flag name is miles' name (``--actor-num-nodes`` for
``actor_num_nodes``) unless given; the help text, choices and list-ness live in the
field's metadata, so flags, YAML keys and dataclass fields can never drift apart.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any


def flag(default: Any, help: str, *, choices: tuple[str, ...] | None = None, name: str | None = None) -> Any:
    """A dataclass field that is also a command-line flag (``--field-name`` by default)."""
    metadata = {"help": help, "choices": choices, "flag": name}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """Everything needed to build one argparse option and to check a YAML value for it."""

    dest: str
    flag: str
    help: str
    default: Any
    base_type: type
    is_list: bool
    optional: bool
    choices: tuple[str, ...] | None

    def convert(self, value: Any) -> Any:
        """Coerce a YAML/CLI value to the field's type; ``ValueError`` naming the flag if impossible."""
        if value is None:
            if self.optional or self.is_list:
                return [] if self.is_list and not self.optional else None
            raise ValueError(f"{self.flag} may not be null")
        if self.is_list:
            items = value if isinstance(value, (list, tuple)) else [value]
            return [self._convert_one(v) for v in items]
        return self._convert_one(value)

    def _convert_one(self, value: Any) -> Any:
        if self.base_type is bool:
            return _to_bool(self.flag, value)
        try:
            converted = self.base_type(value)
        except (TypeError, ValueError):
            raise ValueError(f"{self.flag} expects {self.base_type.__name__}, got {value!r}") from None
        if self.base_type is int and isinstance(value, float) and value != converted:
            raise ValueError(f"{self.flag} expects int, got {value!r}")
        if self.choices is not None and converted not in self.choices:
            raise ValueError(f"{self.flag}: invalid choice {value!r} (choose from {', '.join(self.choices)})")
        return converted


def flag_specs(config_cls: type) -> list[FlagSpec]:
    """The flag specs of one component config class, in declaration order."""
    hints = typing.get_type_hints(config_cls)
    specs = []
    for f in dataclasses.fields(config_cls):
        if "help" not in f.metadata:
            continue
        base_type, is_list, optional = _unpack_type(hints[f.name])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        specs.append(FlagSpec(
            dest=f.name,
            flag=f.metadata.get("flag") or "--" + f.name.replace("_", "-"),
            help=f.metadata["help"],
            default=default,
            base_type=base_type,
            is_list=is_list,
            optional=optional,
            choices=f.metadata.get("choices"),
        ))
    return specs


def _unpack_type(hint: Any) -> tuple[type, bool, bool]:
    """``int | None`` -> (int, False, True); ``list[str]`` -> (str, True, False)."""
    optional = False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
        origin = typing.get_origin(hint)
    if origin is list:
        return typing.get_args(hint)[0], True, optional
    return hint, False, optional


def _to_bool(flag_name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{flag_name} expects true/false, got {value!r}")

