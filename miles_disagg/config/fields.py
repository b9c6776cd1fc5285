"""Declare a config field once; the command-line flag is derived from it.

Each component config is a keyword-only dataclass whose fields are made with
:func:`flag`. The flag name is miles' name (``--actor-num-nodes`` for
``actor_num_nodes``) unless given; the help text, choices and list-ness live in the
field's metadata, so flags, YAML keys and dataclass fields can never drift apart.

The same machinery serves train.py (``config/loader.py``) and every ``miles-disagg``
subcommand (``config/commands.py``): :func:`add_flag` makes the argparse option of a
field, :func:`build_config` makes the dataclass back from flag values, and a bad value
is a ``ConfigError`` naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Mapping, TypeVar

from miles_disagg.types import ConfigError

REQUIRED: Any = dataclasses.MISSING
"""``flag(REQUIRED, ...)``: the flag must be given (the dataclass field has no default)."""

REPEAT_MODES = ("append", "extend")

C = TypeVar("C")


def flag(default: Any, help: str, *, choices: tuple[str, ...] | None = None, name: str | None = None,
         metavar: str | None = None, repeat: str | None = None, positional: bool = False) -> Any:
    """A dataclass field that is also a command-line flag (``--field-name`` by default).

    ``name`` overrides the flag (or, with ``positional``, the argument's display name).
    A list field takes ``--flag a b c`` by default; ``repeat="append"`` takes one value per
    ``--flag`` (repeatable), ``repeat="extend"`` one or more per ``--flag`` (repeatable).
    A positional list field takes the rest of the command line.
    """
    if repeat is not None and repeat not in REPEAT_MODES:
        raise ValueError(f"repeat must be one of {REPEAT_MODES}, got {repeat!r}")
    metadata = {"help": help, "choices": choices, "flag": name, "metavar": metavar, "repeat": repeat,
                "positional": positional}
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
    required: bool = False
    metavar: str | None = None
    repeat: str | None = None
    positional: bool = False

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
        positional = f.metadata.get("positional", False)
        specs.append(FlagSpec(
            dest=f.name,
            flag=f.metadata.get("flag") or (f.name if positional else "--" + f.name.replace("_", "-")),
            help=f.metadata["help"],
            default=default,
            base_type=base_type,
            is_list=is_list,
            optional=optional,
            choices=f.metadata.get("choices"),
            required=default is dataclasses.MISSING,
            metavar=f.metadata.get("metavar"),
            repeat=f.metadata.get("repeat"),
            positional=positional,
        ))
    return specs


def add_flag(group: argparse.ArgumentParser | argparse._ArgumentGroup, spec: FlagSpec) -> None:
    """The argparse option of one field. Unset flags stay absent from the namespace (argparse
    ``SUPPRESS``), so the dataclass (or a YAML file before it) supplies every default."""
    kwargs: dict[str, Any] = {"help": spec.help, "default": argparse.SUPPRESS}
    if spec.positional:
        if spec.is_list:
            kwargs["nargs"] = argparse.REMAINDER
        group.add_argument(spec.flag, metavar=spec.metavar or spec.dest.upper(), **kwargs)
        return
    kwargs["dest"] = spec.dest
    if spec.required:
        kwargs["required"] = True
    if spec.base_type is bool and not spec.is_list:
        group.add_argument(spec.flag, action=argparse.BooleanOptionalAction, **kwargs)
        return
    kwargs["type"] = spec.base_type
    kwargs["metavar"] = spec.metavar or default_metavar(spec)
    if spec.choices:
        kwargs["choices"] = spec.choices
        kwargs.pop("metavar")
    if spec.is_list:
        if spec.repeat == "append":
            kwargs["action"] = "append"
        elif spec.repeat == "extend":
            kwargs.update(action="extend", nargs="+")
        else:
            kwargs["nargs"] = "*"
    if not spec.required and spec.default not in (None, [], argparse.SUPPRESS):
        kwargs["help"] = f"{spec.help} (default: {spec.default})"
    group.add_argument(spec.flag, **kwargs)


_DIR_FIELDS = ("hf_checkpoint", "load", "ref_load", "save")
_METAVAR_SUFFIXES = (("api_key", "KEY"), ("wandb_key", "KEY"), ("_key", "FIELD"), ("_function_path", "MODULE:FUNCTION"),
                     ("_filter_path", "MODULE:FUNCTION"), ("_process_path", "MODULE:FUNCTION"), ("_rm_path", "MODULE:FUNCTION"),
                     ("_write_path", "MODULE:FUNCTION"), ("_hook", "MODULE:FUNCTION"), ("_dir", "DIR"), ("_path", "PATH"),
                     ("_data", "PATH"), ("_url", "URL"), ("_addrs", "HOST:PORT"), ("_addr", "HOST:PORT"),
                     ("_port", "PORT"), ("_host", "HOST"))


def default_metavar(spec: FlagSpec) -> str:
    """What a flag's value is, for ``--help``: a count (``N``), a number (``X``), a directory, a path, a hook
    (``MODULE:FUNCTION``), a URL, ... never the last word of the flag's name (``--actor-num-gpus-per-node NODE``)."""
    if spec.dest == "port" or spec.dest.endswith("_port"):
        return "PORT"
    if spec.base_type is int:
        return "N"
    if spec.base_type is float:
        return "X"
    if spec.dest in _DIR_FIELDS:
        return "DIR"
    for suffix, metavar in _METAVAR_SUFFIXES:
        if spec.dest.endswith(suffix):
            return metavar
    if spec.base_type is not str:
        return "PATH" if spec.base_type.__name__.endswith("Path") else spec.base_type.__name__.upper()
    return spec.dest.upper().split("_")[-1]


def build_config(config_cls: type[C], values: Mapping[str, Any]) -> C:
    """``config_cls`` from flag values keyed by field name (absent ones take the field's default).

    A value that does not convert, or a ``ValueError`` from the class's ``__post_init__``,
    is a ``ConfigError`` naming the flag(s); nothing is half-built.
    """
    kwargs = {}
    for spec in flag_specs(config_cls):
        if spec.dest in values:
            kwargs[spec.dest] = convert_flag(spec, values[spec.dest])
        elif spec.required:
            raise ConfigError(f"{spec.flag} is required", (spec.flag,))
    try:
        return config_cls(**kwargs)
    except ValueError as exc:
        raise ConfigError(str(exc), tuple(w for w in str(exc).split() if w.startswith("--"))) from None


def convert_flag(spec: FlagSpec, value: Any) -> Any:
    """``spec.convert`` with its ``ValueError`` as a ``ConfigError`` naming the flag."""
    try:
        return spec.convert(value)
    except ValueError as exc:
        raise ConfigError(str(exc), (spec.flag,)) from None


class ConfigArgumentParser(argparse.ArgumentParser):
    """argparse whose errors become ``ConfigError`` (so the caller controls the exit)."""

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        raise ConfigError(message)


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

