"""Every exception class of the package survives pickling (Ray and process boundaries) with its
fields, and each error name means one class."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import miles_disagg
from miles_disagg.types import VersionConstraint, VersionRef

# Classes whose constructor takes more than a message: how to make one.
SPECIAL = {
    "ConfigError": lambda cls: cls("bad --flag", ("--flag",)),
    "VersionNotReady": lambda cls: cls(VersionConstraint(min_version=3), [1, 2]),
    "PublishConflict": lambda cls: cls(VersionRef("r", 1), VersionRef("r", 2), VersionRef("r", 2)),
    "LineageError": lambda cls: cls("wrong base", expected=VersionRef("r", 1), actual=VersionRef("s", 1)),
    "ChecksumMismatch": lambda cls: cls("w", "aa", "bb", "xxh3-128"),
    "ProbeFailed": lambda cls: cls("no answer", definite=False),
    "NotHealthy": lambda cls: cls("exited with 3", 3),
    "UnknownWorker": lambda cls: cls("http://127.0.0.1:1"),
    "VersionNotPrepared": lambda cls: cls("7", VersionRef("r", 6)),
    "BufferTimeout": lambda cls: cls(8, 3, 1.5),
    "WorkerFailed": lambda cls: cls("http://127.0.0.1:1", "reset"),
    "WorkerVersionMismatch": lambda cls: cls("http://127.0.0.1:1", 3, 2),
    "NodeLost": lambda cls: cls("node 10.0.0.2 left", node_id="ab" * 28, node_ip="10.0.0.2"),
    "RunInterrupted": lambda cls: cls(15),
    "PrefixMismatch": lambda cls: cls("s1", 12, "the engine got another prompt"),
}


def _package_exception_classes() -> list[type]:
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(miles_disagg.__path__, "miles_disagg."):
        try:
            module = importlib.import_module(info.name)
        except ImportError as exc:  # an optional backend (megatron) missing here
            pytest.skip(f"{info.name} does not import here: {exc}")
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("miles_disagg."):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]


CLASSES = _package_exception_classes()


def _make(cls: type) -> BaseException:
    for name in [c.__name__ for c in cls.__mro__]:
        if name in SPECIAL:
            return SPECIAL[name](cls)
    return cls("something went wrong")


def test_the_package_defines_the_error_classes_it_should():
    names = {cls.__name__ for cls in CLASSES}
    assert {"ConfigError", "VersionNotReady", "EngineUnreachable", "ActivationFailed", "BufferTimeout"} <= names


def test_every_error_name_is_one_class():
    by_name: dict[str, list[str]] = {}
    for cls in CLASSES:
        by_name.setdefault(cls.__name__, []).append(f"{cls.__module__}.{cls.__qualname__}")
    assert {name: where for name, where in by_name.items() if len(where) > 1} == {}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_an_error_survives_pickling_with_its_fields(cls: type) -> None:
    error = _make(cls)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert str(copy) == str(error)
    assert copy.args == error.args
    assert vars(copy) == vars(error)


def test_an_error_survives_rays_serializer():
    from ray import cloudpickle

    from miles_disagg.types import VersionNotReady

    error = VersionNotReady(VersionConstraint(exact_version=4), [3])
    copy = cloudpickle.loads(cloudpickle.dumps(error))
    assert (copy.constraint, copy.available, str(copy)) == (error.constraint, [3], str(error))
