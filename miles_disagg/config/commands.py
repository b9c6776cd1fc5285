"""Subcommand flags from config dataclasses (``miles-disagg engine``, ``router``, ``agent``, ...).

Each subcommand (and each action of ``weights``, ``serve`` and ``bench``) has one
keyword-only config dataclass whose fields are made with :func:`~miles_disagg.config.fields.flag`,
as train.py's components are. ``add_arguments(parser)`` is :func:`add_config_arguments`
and ``run(args)`` starts with :func:`config_from_args`; a command with actions uses
:func:`add_actions` and :func:`action_config`. Conversions, choices, bool switches
(``--x/--no-x``), lists and errors are train.py's: a bad value or a ``ValueError`` from the
dataclass is a ``ConfigError`` naming the flag, which ``miles-disagg`` prints as one line
with exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

from miles_disagg.net.asgi_guard import DEFAULT_MAX_REQUEST_BYTES, MAX_REQUEST_BYTES_HELP
from miles_disagg.config.fields import add_flag, build_config, flag, flag_specs

LOG_LEVELS = ("debug", "info", "warning", "error")
API_KEY_HELP = ("Key every endpoint but /health* requires as 'Authorization: Bearer KEY' (SGLang's --api-key); "
                "default: $MILES_DISAGG_API_KEY, which keeps it out of ps.")
ADMIN_API_KEY_HELP = ("Key the weight, pause, version, registry and drain endpoints require (SGLang's "
                      "--admin-api-key); default: $MILES_DISAGG_ADMIN_API_KEY.")

C = TypeVar("C")


def add_config_arguments(parser: argparse.ArgumentParser, *config_classes: type) -> None:
    """One option (or positional argument) per flag field of each class, in declaration order."""
    for config_cls in config_classes:
        for spec in flag_specs(config_cls):
            add_flag(parser, spec)


def config_from_args(config_cls: type[C], args: argparse.Namespace) -> C:
    """``config_cls`` from a namespace parsed by :func:`add_config_arguments` (other keys are ignored)."""
    return build_config(config_cls, vars(args))


def add_actions(parser: argparse.ArgumentParser, dest: str, metavar: str, actions: Mapping[str, type]) -> None:
    """Mutually exclusive actions (``weights publish|apply|...``), one config class each; the
    first line of the class's docstring is the action's help."""
    subparsers = parser.add_subparsers(dest=dest, metavar=metavar, required=True)
    for name, config_cls in actions.items():
        help_text = summary(config_cls)
        add_config_arguments(subparsers.add_parser(name, help=help_text, description=help_text), config_cls)


def action_config(args: argparse.Namespace, dest: str, actions: Mapping[str, type]) -> Any:
    """The config of the action the command line chose (see :func:`add_actions`)."""
    return config_from_args(actions[getattr(args, dest)], args)


def summary(config_cls: type) -> str:
    """First line of a config class's docstring: the help of its (sub)command."""
    return (config_cls.__doc__ or "").strip().splitlines()[0]


@dataclass(kw_only=True)
class LogFlags:
    """Flags of every long-running command."""

    log_level: str = flag("warning", "Level of the log written to stderr.", choices=LOG_LEVELS)

    def configure_logging(self) -> None:
        logging.basicConfig(level=self.log_level.upper(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@dataclass(kw_only=True)
class ServerFlags(LogFlags):
    """Flags of a command that serves HTTP (subclasses set their own ``--port`` default)."""

    host: str = flag("127.0.0.1", "Address to bind (loopback only unless told otherwise).")
    port: int = flag(0, "HTTP port (0: any free port).")
    api_key: str | None = flag(None, API_KEY_HELP, metavar="KEY")
    admin_api_key: str | None = flag(None, ADMIN_API_KEY_HELP, metavar="KEY")
    max_request_bytes: int = flag(DEFAULT_MAX_REQUEST_BYTES, MAX_REQUEST_BYTES_HELP, metavar="N")

    def __post_init__(self) -> None:
        self.guard()  # bad keys or limit: ValueError naming the flag
        getattr(super(), "__post_init__", lambda: None)()  # mixins' own checks (cooperative)

    def guard(self):
        """The keys (flags, else the environment) and request limit this server enforces."""
        from miles_disagg.net.asgi_guard import ServerGuard
        from miles_disagg.net.auth import ApiKeys

        return ServerGuard(ApiKeys.resolve(self.api_key, self.admin_api_key), self.max_request_bytes)

    def export_keys(self) -> None:
        """Put the keys given as flags into this process's environment, so every child it starts
        (gateway, replicas, engines) gets them without a command line that ``ps`` shows."""
        import os

        os.environ.update(self.guard().keys.env())
