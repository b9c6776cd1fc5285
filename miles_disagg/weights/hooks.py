"""Loading the weight hooks (``module:function`` strings or callables), checked up front.

* post-write (``--custom-update-weight-post-write-path``), called as
  ``hook(version_dir: str, ref: VersionRef)`` after a version's files are written and
  renamed into place, before ``LATEST`` moves; raising aborts the publish. (miles calls
  its hook as ``(args, path, rollout_engines)``; such a hook is refused at load with a
  ``ConfigError`` naming the expected parameters.)
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
from typing import Any, Callable

from miles_disagg.types import ConfigError

POST_WRITE_FLAG = "--custom-update-weight-post-write-path"
PRE_READ_FLAG = "--sglang-custom-pull-weights-pre-read-hook"


HOOK_PARAMETERS = {POST_WRITE_FLAG: ("version_dir", "ref"), PRE_READ_FLAG: ("source_dir", "target_version")}


def load_hook(spec: str | Callable[..., Any] | None, flag: str) -> Callable[..., Any] | None:
    """Resolve and signature-check a hook; ``ConfigError`` naming ``flag`` when unusable."""
    if spec is None or spec == "":
        return None
    fn = _resolve(spec, flag) if isinstance(spec, str) else spec
    if not callable(fn):
        raise ConfigError(f"{flag}: {spec!r} is not callable", flags=(flag,))
    parameters = HOOK_PARAMETERS[flag]
    try:
        inspect.signature(fn).bind(*parameters)
    except TypeError:
        raise ConfigError(
            f"{flag}: {getattr(fn, '__qualname__', fn)!r} must accept ({', '.join(parameters)}); "
            f"its signature is {inspect.signature(fn)}",
            flags=(flag,),
        ) from None
    except ValueError:
        pass  # builtins without a signature: trust them
    return fn


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
