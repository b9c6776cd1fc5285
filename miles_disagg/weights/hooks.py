"""Loading the weight hooks (``module:function`` or miles' dotted ``module.function`` strings, or
callables), checked up front.

* post-write (``--custom-update-weight-post-write-path``), called once per version after the
  version's files are written and renamed into place, before ``LATEST`` moves (so before any
  host can use the version); raising aborts the publish. Two signatures are accepted:
  this project's ``hook(version_dir: str, ref: VersionRef)``, and miles'
  ``hook(args, version_dir: str, rollout_engines)`` (``args``: the run's flags as attributes,
  miles' names; ``rollout_engines``: the engines' URLs, empty when none are known).
* pre-read (``--sglang-custom-pull-weights-pre-read-hook``), called as
  ``hook(source_dir: str, target_version: int)`` (the signature of SGLang's pull-weights
  pre-read hook, so existing hooks work unchanged) once per prepare, before a host reads
  anything of the store at ``source_dir``, for a target above 0 (as SGLang's /pull_weights
  calls it; without an explicit target, after the latest version number was read);
  raising aborts the prepare.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from miles_disagg.types import ConfigError

POST_WRITE_FLAG = "--custom-update-weight-post-write-path"
PRE_READ_FLAG = "--sglang-custom-pull-weights-pre-read-hook"


HOOK_PARAMETERS = {POST_WRITE_FLAG: ("version_dir", "ref"), PRE_READ_FLAG: ("source_dir", "target_version")}
MILES_POST_WRITE_PARAMETERS = ("args", "version_dir", "rollout_engines")


@dataclass
class MilesHookContext:
    """What a miles-signature post-write hook receives besides the version directory."""

    args: Any = None
    """The run's flags as attributes under miles' names (``args.update_weight_disk_dir``, ...)."""
    rollout_engines: Callable[[], Sequence[str]] = field(default=lambda: ())
    """The engines' URLs at call time (empty before they are known, and in the service topology)."""


def load_hook(spec: str | Callable[..., Any] | None, flag: str,
              miles_context: MilesHookContext | None = None) -> Callable[..., Any] | None:
    """Resolve and signature-check a hook; ``ConfigError`` naming ``flag`` when unusable.

    A post-write hook with miles' signature comes back wrapped as ``hook(version_dir, ref)``."""
    if spec is None or spec == "":
        return None
    fn = _resolve(spec, flag) if isinstance(spec, str) else spec
    if not callable(fn):
        raise ConfigError(f"{flag}: {spec!r} is not callable", flags=(flag,))
    parameters = HOOK_PARAMETERS[flag]
    if _accepts(fn, parameters):
        return fn
    if flag == POST_WRITE_FLAG and _accepts(fn, MILES_POST_WRITE_PARAMETERS):
        return _miles_post_write(fn, miles_context or MilesHookContext())
    accepted = f"({', '.join(parameters)})"
    if flag == POST_WRITE_FLAG:
        accepted += f" or miles' ({', '.join(MILES_POST_WRITE_PARAMETERS)})"
    raise ConfigError(f"{flag}: {getattr(fn, '__qualname__', fn)!r} must accept {accepted}; its signature is "
                      f"{inspect.signature(fn)}", flags=(flag,))


def _accepts(fn: Callable[..., Any], parameters: Sequence[str]) -> bool:
    try:
        inspect.signature(fn).bind(*parameters)
    except TypeError:
        return False
    except ValueError:
        return True  # builtins without a signature: trust them
    return True


def _miles_post_write(fn: Callable[..., Any], context: MilesHookContext) -> Callable[[str, Any], Any]:
    def post_write(version_dir: str, ref: Any) -> Any:
        return fn(context.args, version_dir, list(context.rollout_engines()))

    post_write.__qualname__ = getattr(fn, "__qualname__", "post_write")
    post_write.miles_signature = True  # type: ignore[attr-defined]
    return post_write


def _resolve(spec: str, flag: str) -> Callable[..., Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep:  # also accept the dotted form miles uses: package.module.function
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{flag}: {spec!r} is not of the form module:function", flags=(flag,))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{flag}: cannot import module {module_name!r} ({exc})", flags=(flag,)) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{flag}: module {module_name!r} has no attribute {attr!r}", flags=(flag,)) from None
