"""miles' import paths for user code (``from miles.utils.types import Sample`` ...), served by this
project when miles itself is not installed, and never in front of a real miles.

:func:`install_miles_imports` appends a finder at the END of ``sys.meta_path``: Python asks it
only after every other finder failed to find ``miles``, so a ``miles`` on ``sys.path`` always wins
(and then this finder never serves a ``miles.*`` submodule either). Every process that loads user
hooks installs it (``rollout/hooks.py``, ``rollout/rewards.py``).

Each served module is a small facade of this package's modules (:data:`FACADES`): its names
behave with miles' meaning; a name or module of miles that is not served here raises one line
saying so.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

_HERE = "miles_disagg.rollout.miles_compat"

FACADES: dict[str, tuple[str | types.ModuleType | None, tuple[str, ...], bool]] = {
    # miles module: (our module, or its name; its names served; is a package). The trainer adds
    # miles' loss API (:func:`serve_modules`) where it loads loss hooks.
    "miles": (None, (), True),
    "miles.utils": (None, (), True),
    "miles.utils.types": (f"{_HERE}.utils_types", ("Sample", "RolloutBatch"), False),
    "miles.utils.http_utils": (f"{_HERE}.http_utils", ("post", "get"), False),
    "miles.utils.misc": (f"{_HERE}.http_utils", ("load_function",), False),
    "miles.rollout": (None, (), True),
    "miles.rollout.sglang_rollout": (f"{_HERE}.sglang_rollout",
                                     ("GenerateState", "generate", "generate_and_rm", "generate_and_rm_group"), False),
    "miles.rollout.on_policy_distillation": (f"{_HERE}.on_policy_distillation",
                                             ("reward_func", "post_process_rewards"), False),
    "miles.rollout.base_types": (f"{_HERE}.base_types",
                                 ("RolloutFnConstructorInput", "RolloutFnBaseInput", "RolloutFnTrainInput",
                                  "RolloutFnEvalInput", "RolloutFnTrainOutput", "RolloutFnEvalOutput",
                                  "call_rollout_fn"), False),
    "miles.rollout.rm_hub": (f"{_HERE}.rm_hub", ("async_rm", "batched_async_rm", "grade_answer_verl",
                                                  "extract_boxed_answer", "f1_score", "compute_gpqa_reward",
                                                  "get_deepscaler_rule_based_reward"), True),
    "miles.rollout.rm_hub.math_dapo_utils": (f"{_HERE}.rm_hub", ("compute_score", "normalize_final_answer",
                                                                  "last_boxed_only_string", "remove_boxed"), False),
    "miles.rollout.rm_hub.math_utils": (f"{_HERE}.rm_hub", ("extract_answer", "grade_answer_verl"), False),
    "miles.rollout.rm_hub.f1": (f"{_HERE}.rm_hub", ("f1_score",), False),
    "miles.rollout.rm_hub.gpqa": (f"{_HERE}.rm_hub", ("compute_gpqa_reward",), False),
    "miles.rollout.rm_hub.deepscaler": (f"{_HERE}.rm_hub", ("get_deepscaler_rule_based_reward",), False),
    "miles.rollout.filter_hub": (None, (), True),
    "miles.rollout.filter_hub.base_types": ("miles_disagg.rollout.filters", ("DynamicFilterOutput",), False),
    "miles.rollout.filter_hub.dynamic_sampling_filters": ("miles_disagg.rollout.filters",
                                                          ("check_reward_nonzero_std",), False),
}

FACADE_MARK = "__miles_disagg_facade__"


class MilesImportFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves :data:`FACADES` when no real ``miles`` is importable."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "miles" and not fullname.startswith("miles."):
            return None
        if fullname != "miles" and not getattr(sys.modules.get("miles"), FACADE_MARK, False):
            return None  # a real miles is imported: its own submodules only
        if fullname not in FACADES:
            raise ModuleNotFoundError(
                f"{fullname} is a miles module that miles-disagg does not serve (miles is not installed; served: "
                f"{', '.join(sorted(n for n in FACADES if not FACADES[n][2] or FACADES[n][1]))}); docs/from-miles.md, "
                "\"Porting your miles rollout code\", says what to use instead", name=fullname)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=FACADES[fullname][2])

    def create_module(self, spec):
        return facade(spec.name)

    def exec_module(self, module):
        return None


def facade(name: str) -> types.ModuleType:
    """A new module ``name`` holding the served names of its ``FACADES`` entry."""
    source, names, is_package = FACADES[name]
    module = types.ModuleType(name, f"miles' {name}, served by miles-disagg ({source or 'a package'})")
    setattr(module, FACADE_MARK, True)
    if is_package:
        module.__path__ = []
    if source:
        ours = source if isinstance(source, types.ModuleType) else importlib.import_module(source)
        for attr in names:
            setattr(module, attr, getattr(ours, attr))
    module.__all__ = list(names)

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(f"{name}.{attr} is a miles name that miles-disagg does not serve (here {name} has "
                             f"{', '.join(names) or 'no names'}); see docs/from-miles.md, \"Porting your miles rollout code\"")

    module.__getattr__ = __getattr__
    return module


def serve_modules(entries: dict[str, tuple[types.ModuleType | None, tuple[str, ...], bool]]) -> None:
    """Serve more of miles' modules (``FACADES`` entries; a source given as a module object, so the
    room that owns it names it): a package that serves them registers them before user code
    imports them. An entry already served is left as it is."""
    for name, entry in entries.items():
        FACADES.setdefault(name, entry)


def install_miles_imports() -> None:
    """Append the finder to ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, MilesImportFinder) for f in sys.meta_path):
        sys.meta_path.append(MilesImportFinder())
