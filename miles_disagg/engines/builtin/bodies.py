"""What every request body of the built-in engine shares: the strict pydantic base and its field types.

``Model.from_json(raw_body_or_dict)`` validates strictly (an int field takes no float, string or bool)
and raises ``InvalidInput`` with a message naming the field; nothing is half-parsed. Unknown fields are
ignored and ``null`` means the default, as in SGLang. The bodies themselves: ``/generate``'s in
``protocol.py``, the control endpoints' in ``control_bodies.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Self

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from miles_disagg.net.httpjson import parse_body


def as_tuple(value: Any) -> Any:
    """A JSON array as a tuple (strict validation takes tuples only)."""
    return tuple(value) if isinstance(value, list) else value


def version_string(value: Any) -> Any:
    """SGLang's versions are strings; ints are accepted and reported as their decimal string."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value:
        return value
    raise ValueError(f"must be a non-empty string or an int, got {value!r}")


def no_nul(value: str) -> str:
    """A path with a NUL byte names no file (the OS refuses it): 400, not a server error."""
    if "\x00" in value:
        raise ValueError("a path must not contain a NUL byte")
    return value


NonEmptyStr = Annotated[str, Field(min_length=1)]
PathStr = Annotated[str, Field(min_length=1), AfterValidator(no_nul)]
Ints = Annotated[tuple[int, ...], BeforeValidator(as_tuple)]
Strings = Annotated[tuple[str, ...], BeforeValidator(as_tuple)]
TokenId = Annotated[int, Field(ge=0)]
VersionString = Annotated[str, BeforeValidator(version_string)]


class Body(BaseModel):
    """A JSON request body: strict types, unknown fields ignored, ``null`` meaning the default."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, obj: Any) -> Any:
        return {k: v for k, v in obj.items() if v is not None} if isinstance(obj, dict) else obj

    @classmethod
    def from_json(cls, body: bytes | Any) -> Self:
        """The body (raw bytes or decoded JSON) validated; ``InvalidInput`` naming the field otherwise."""
        return parse_body(cls, body)
