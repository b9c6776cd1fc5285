"""Checks the config dataclasses share in their ``__post_init__``: a failed one is a ``ValueError``
naming the flag (the parser turns it into one line, exit 2)."""

from __future__ import annotations


def require(condition: bool, message: str) -> None:
    """``ValueError(message)`` unless ``condition``."""
    if not condition:
        raise ValueError(message)


def is_resource_name(value: str) -> bool:
    """A custom resource a node can offer (Ray's own CPU/GPU/memory are not a node's label)."""
    return bool(value) and value.strip() == value and value not in ("CPU", "GPU", "memory", "object_store_memory")


def is_hook_path(value: str) -> bool:
    """``pkg.module:function`` (this project's form) or ``pkg.module.function`` (miles' dotted form)."""
    module, sep, function = value.partition(":") if ":" in value else value.rpartition(".")
    return bool(sep and module and function.isidentifier()
                and all(part.isidentifier() for part in module.split(".")))
