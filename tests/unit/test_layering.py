"""Imports point down the package list of the README's code map: a lower package never imports a
higher one (entry-point ``__main__`` modules excepted: they only hand over to ``cli``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "miles_disagg"

# Each package may import only packages listed after it (and itself).
ORDER = ["launcher", "cli", "bench", "loop", "service", "trainer", "fleet", "rollout", "engines", "router", "weights", "models",
         "config", "tracking", "distributed", "remote", "net", "types", "startup"]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("miles_disagg."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("miles_disagg.")}
    return found


def test_imports_point_down_the_code_map():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__main__.py":
            continue
        relative = path.relative_to(PACKAGE)
        owner = relative.parts[0].removesuffix(".py")
        if owner == "__init__":
            continue
        assert owner in ORDER, f"{relative}: add its package to the code map (README and ORDER)"
        allowed = set(ORDER[ORDER.index(owner):])
        wrong += [f"{relative} imports miles_disagg.{m}" for m in sorted(_imports(path) - allowed)]
    assert wrong == []


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
