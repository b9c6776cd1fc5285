"""The package's structure rules, checked over every import (module-level, inside functions and under
``TYPE_CHECKING``):

- imports point down the rooms of DESIGN's package map: a lower room never imports a higher one
  (entry-point ``__main__`` modules excepted: they only hand over to ``cli``);
- no import cycle between the package's modules, inside a room as well as between rooms;
- no module imports an underscore name from another module of the package;
- no module reads or writes another object's underscore members (``other._x``), except the named
  third-party internals in :data:`FOREIGN_INTERNALS`.

Each rule is a function over a package directory, so the tests below also plant a violation in a small
package of their own and see the rule fail on it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "miles_disagg"

# Each room may import only rooms listed after it (and itself).
ORDER = ["launcher", "cli", "bench", "loop", "service", "trainer", "fleet", "rollout", "engines", "router", "weights",
         "models", "config", "tracking", "distributed", "remote", "net", "samples", "types", "startup"]

# Underscore members of third-party objects this package has to reach (module path, attribute): each is
# the only way to the value it names in the library version this project pins.
FOREIGN_INTERNALS = {
    ("cli.py", "_actions"), ("cli.py", "_SubParsersAction"),  # argparse: a parser's actions, subparsers
    ("config/fields.py", "_ArgumentGroup"), ("config/loader.py", "_actions"), ("loop/sglang_check.py", "_actions"),
    ("distributed.py", "_new_process_group_helper"), ("distributed.py", "_world"),  # torch.distributed c10d
    ("trainer/megatron/cpu_patches.py", "_get_cuda_rng_state"), ("trainer/megatron/cpu_patches.py", "_set_cuda_rng_state"),
    ("trainer/megatron/cpu_patches.py", "_maybe_dtoh_and_synchronize"),  # megatron-core's CUDA-only helpers
    ("trainer/torch_dist.py", "_results_queue"),  # torch.distributed.checkpoint's async writer
    ("bench/sim/engines.py", "_server"),  # aiohttp: the bound port of a site
}


def module_name(package: Path, path: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(package: Path) -> dict[str, Path]:
    return {module_name(package, path): path for path in sorted(package.rglob("*.py"))}


def _targets(modules: dict[str, Path], module: str, node: ast.AST, is_package: bool) -> list[tuple[str, str | None]]:
    """(imported module of the package, imported name or None) for one import statement."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: None if is_package else -1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in modules else (base, a.name) for a in node.names]


def _owner(modules: dict[str, Path], dotted: str) -> str | None:
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def import_graph(package: Path) -> tuple[dict[str, set[str]], list[str]]:
    """Edges module -> imported module (every import statement anywhere in the module), and the imports
    of an underscore name from another module."""
    modules = package_modules(package)
    edges: dict[str, set[str]] = {name: set() for name in modules}
    private = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for dotted, imported in _targets(modules, name, node, path.name == "__init__.py"):
                target = _owner(modules, dotted)
                if target is None or target == name:
                    continue
                edges[name].add(target)
                if imported and imported.startswith("_") and not imported.startswith("__"):
                    private.append(f"{name}:{node.lineno} imports {imported} from {target}")
    return edges, private


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def _own_members(tree: ast.AST) -> set[str]:
    """Underscore names this module defines as members of its own classes (``self._x = ...``, methods,
    class attributes): a module may touch those on any instance of its own classes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    return {name for name in names if name.startswith("_")}


def foreign_member_access(package: Path, allowed: set[tuple[str, str]] = frozenset()) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        tree = ast.parse(path.read_text())
        own = _own_members(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in own or (relative, node.attr) in allowed:
                continue
            found.append(f"{relative}:{node.lineno} {ast.unparse(node)}")
    return found


def layering_violations(package: Path, order: list[str]) -> list[str]:
    edges, _ = import_graph(package)
    root = package.name
    wrong = []
    for module, targets in edges.items():
        parts = module.split(".")
        if len(parts) < 2 or parts[-1] == "__main__" or parts[1] == "__init__":
            continue
        owner = parts[1]
        assert owner in order, f"{module}: add its room to DESIGN's package map and ORDER"
        allowed = set(order[order.index(owner):])
        wrong += [f"{module} imports {t}" for t in sorted(targets)
                  if t.startswith(f"{root}.") and t.split(".")[1] not in allowed]
    return wrong


# -- the rules on this package ----------------------------------------------------------------------

def test_imports_point_down_the_package_map():
    assert layering_violations(PACKAGE, ORDER) == []


def test_no_import_cycle_counting_function_local_and_type_checking_imports():
    edges, _ = import_graph(PACKAGE)
    assert import_cycles(edges) == []


def test_no_module_imports_an_underscore_name_of_another():
    _, private = import_graph(PACKAGE)
    assert private == []


def test_no_module_touches_another_objects_underscore_members():
    assert foreign_member_access(PACKAGE, FOREIGN_INTERNALS) == []


# -- the rules catch what they are for ------------------------------------------------------------------

def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "pkg"
    for relative, text in {"__init__.py": "", **files}.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_a_function_local_import_cycle_inside_a_room_is_found(tmp_path):
    package = _plant(tmp_path, {
        "room/__init__.py": "",
        "room/a.py": "from pkg.room.b import helper\n",
        "room/b.py": "def helper():\n    from pkg.room import a\n    return a\n",
        "room/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.room.d import D\n",
        "room/d.py": "import pkg.room.c\n",
    })
    edges, _ = import_graph(package)
    assert import_cycles(edges) == [["pkg.room.a", "pkg.room.b"], ["pkg.room.c", "pkg.room.d"]]


def test_a_relative_import_cycle_is_found(tmp_path):
    package = _plant(tmp_path, {"a.py": "from . import b\n", "b.py": "def f():\n    from .a import x\n"})
    edges, _ = import_graph(package)
    assert import_cycles(edges) == [["pkg.a", "pkg.b"]]


def test_an_underscore_name_imported_from_a_sibling_is_found(tmp_path):
    package = _plant(tmp_path, {"a.py": "_secret = 1\n__all__ = []\n",
                                "b.py": "def f():\n    from pkg.a import _secret, __all__\n"})
    _, private = import_graph(package)
    assert private == ["pkg.b:2 imports _secret from pkg.a"]


def test_another_objects_underscore_member_is_found(tmp_path):
    package = _plant(tmp_path, {
        "owner.py": "class Owner:\n    def __init__(self):\n        self._state = 1\n"
                    "    def same(self, other):\n        return other._state\n",
        "user.py": "def peek(owner):\n    owner._state = 2\n    return owner.__class__\n",
    })
    assert foreign_member_access(package) == ["user.py:2 owner._state"]


def test_an_upward_import_is_found(tmp_path):
    package = _plant(tmp_path, {"high/__init__.py": "", "low/__init__.py": "",
                                "low/x.py": "def f():\n    import pkg.high\n"})
    assert layering_violations(package, ["high", "low"]) == ["pkg.low.x imports pkg.high"]


def test_the_driver_side_imports_no_torch():
    """The driver (``train.py``/``train_async.py``: the loop, the trainer group's handle, the report,
    and the classes of what the actors return to it) never imports torch: about 3 CPU-seconds per
    run that only the trainer ranks and engines need."""
    import subprocess
    import sys

    driver_modules = ["miles_disagg.launcher", "miles_disagg.loop.job", "miles_disagg.loop.train_loops",
                      "miles_disagg.loop.report", "miles_disagg.trainer.group", "miles_disagg.rollout.handle",
                      "miles_disagg.fleet.handle",
                      # what the actors send back: unpickling a result imports the module defining its class
                      "miles_disagg.trainer.results", "miles_disagg.weights.publisher", "miles_disagg.weights.probe"]
    probe = "; ".join(f"import {m}" for m in driver_modules) + "; import sys; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
