"""The README and every page of ``docs/`` stand alone and say what the code does.

Pages: ``README.md`` and every ``docs/**/*.md`` except ``docs/reference/`` (miles' pages, kept as
miles wrote them: only their relative links are checked).

* every relative link resolves in a clone (a file of the repository, and its ``#anchor`` when the
  target is a page), and no page links ``../shared``; every repository path named in backticks
  (``miles_disagg/...``, ``tests/...``, ``scripts/...``, ...) exists;
* every ``--flag`` a page names is a flag of ``train.py``/``train_async.py`` or of a
  ``miles-disagg`` command, a refused miles flag, the ``--sglang-*`` passthrough, or one of the few
  flags of other tools the pages show (Ray, pytest, pip, SGLang, ``scripts/gpu_check.sh``);
* DESIGN's package map is the code map: it lists the rooms in the layering test's order, every room
  and sub-room of the package is in it, and every module it names exists;
* every command of the pages' ``bash`` blocks runs or parses: each distinct ``train.py`` /
  ``train_async.py`` command once across all pages (``--print-config``, ``--dry-run`` and ``--help``
  as shown, training shortened to two tiny steps, unless a whole-run test runs that command:
  ``documented_runs.RUN_BY``); ``./scripts/demo.sh`` (run whole by ``test_tiny_cpu_main_job.py``);
  ``./scripts/test.sh`` (collection only; its variants' pytest options are checked); the
  ``miles-disagg weights`` chain on a tiny model; every other ``miles-disagg`` line is parsed by the
  command's own parser (servers are not left running); cluster and service lines have their
  ``train*.py`` flags parsed; ``ray`` lines are Ray's own. A command of any other kind fails the test
  until this file learns how to check it.

Pages are found, and commands read from their code blocks, generally: a page added to ``docs/`` is
checked as soon as it exists. The suite's time budget is tight, so a page must not add whole runs:
``test_whole_runs_stay_few`` caps them.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from deadlines import scaled
from documented_runs import RUN_BY

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
REFERENCE = DOCS / "reference"
DESIGN = DOCS / "DESIGN.md"

OTHER_TOOLS_FLAGS = {
    # ray start / ray job submit (docs/cluster.md)
    "--head", "--num-gpus", "--dashboard-port", "--dashboard-host", "--resources", "--working-dir", "--address",
    "--dist", "--strict-markers", "--cpu-durations",  # pytest, and the suite's own option (docs/development.md, benchmarks.md)
    "--no-deps",  # pip (the SGLang tier)
    "--enable-memory-saver",  # SGLang's own flag, which managed colocated engines get
    "--ep-size", "--tp-size", "--base-gpu-id",  # SGLang's own flags, which our argv sets
    "--generate",  # ray get-auth-token --generate
    "--no-x",  # the example of the boolean pattern (--x / --no-x, docs/flags.md)
    "--prot", "--rollout-batch-sise",  # typos in the "did you mean" examples
}
GPU_CHECK_FLAGS = {"--cpu", "--only"}  # scripts/gpu_check.sh (miles_disagg/bench/gpu_check.py)
PATH_PREFIXES = ("configs/", "scripts/", "miles_disagg/", "tests/", "docs/", ".ci/")
ROOT_FILES = ("train.py", "train_async.py", "pyproject.toml", "README.md")
MAX_WHOLE_RUNS = 4
"""Training commands the pages may show that this test runs (two tiny steps each): the suite's time budget."""


def pages() -> list[Path]:
    """The README and every docs page this test checks (not ``docs/reference/``)."""
    return [README, *sorted(p for p in DOCS.rglob("*.md") if REFERENCE not in p.parents)]


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


def code_blocks(text: str, languages: tuple[str, ...] = ("bash",)) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M) if m.group(1) in languages]


def prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings."""
    headings = re.findall(r"^#+ (.*)$", prose(page.read_text(encoding="utf-8")), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def commands(text: str) -> list[list[str]]:
    """Every command line of a text's bash blocks (continuations joined, comments dropped)."""
    found = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                found.append(argv)
    return found


def all_commands() -> list[tuple[str, list[str]]]:
    return [(_name(page), argv) for page in pages() for argv in commands(page.read_text(encoding="utf-8"))]


def all_known_flags() -> set[str]:
    from miles_disagg.cli import SUBCOMMANDS, _option_strings, build_parser
    from miles_disagg.config.loader import build_parser as build_run_parser

    flags = set()
    for entry in ("train", "train_async"):
        flags |= set(_option_strings(build_run_parser(entry)))
    for name in SUBCOMMANDS:
        flags |= set(_option_strings(build_parser([name])))
    return flags


# ---------------------------------------------------------------------------------- links, paths, flags

def _check_link(page: Path, target: str) -> str | None:
    """Why a relative link of ``page`` does not resolve in a clone, or None."""
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    if REPO not in resolved.parents and resolved != REPO:
        return "points outside the repository"
    if not resolved.exists():
        return "no such file"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"no section #{anchor} in {resolved.relative_to(REPO)}"
    return None


def test_links_resolve_in_a_clone() -> None:
    broken = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        if "../shared" in text:
            broken.append(f"{_name(page)}: links ../shared (not in a clone)")
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(text)):
            if target.startswith(("http://", "https://")):
                continue
            why = _check_link(page, target)
            if why:
                broken.append(f"{_name(page)} links {target}: {why}")
    for page in REFERENCE.rglob("*.md"):  # miles' pages: links starting with / are miles' site
        for target in re.findall(r"\]\(([^)#\s]+)\)", page.read_text(encoding="utf-8")):
            if not target.startswith(("http", "/")) and not (page.parent / target).exists():
                broken.append(f"{_name(page)} links {target}: no such file")
    assert not broken, "\n".join(broken)


def test_paths_named_exist() -> None:
    missing = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"`([^`\s]+)`", text):
            if text[max(m.start() - 7, 0):m.start()] == "miles' ":
                continue  # a file of miles' repository
            path = m.group(1).rstrip(".,:;)")
            if (path.startswith(PATH_PREFIXES) or path in ROOT_FILES) and not any(c in path for c in "*{<"):
                if not (REPO / path).exists():
                    missing.append(f"{_name(page)} names {path}")
    assert not missing, "not in the repository:\n" + "\n".join(missing)


def test_every_flag_named_exists() -> None:
    from miles_disagg.config.miles_flags import REFUSED_FLAGS

    known = all_known_flags() | set(REFUSED_FLAGS) | OTHER_TOOLS_FLAGS
    gpu_check = (REPO / "miles_disagg/bench/gpu_check.py").read_text()
    assert all(f'"{flag}"' in gpu_check for flag in GPU_CHECK_FLAGS)
    missing = set()
    for page in pages():
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"(?<![\w-])--[a-z0-9][a-z0-9-]*[a-z0-9]", text):
            flag, following = m.group(), text[m.end():m.end() + 1]
            if following in ("*", "-") or flag.startswith("--sglang-") or flag in GPU_CHECK_FLAGS:
                continue  # a family (--eval-*), or the --sglang-* passthrough
            if flag not in known:
                missing.add(f"{_name(page)}: {flag}")
    assert not missing, "flags nothing takes:\n" + "\n".join(sorted(missing))


def test_docs_index_lists_every_page() -> None:
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in re.findall(r"\]\(([^)\s]+)\)", index)}
    unlisted = [_name(p) for p in DOCS.rglob("*.md") if p != DOCS / "README.md" and p.resolve() not in linked]
    assert not unlisted, f"docs/README.md does not list: {unlisted}"


# ---------------------------------------------------------------------------------------- the code map

def _layering_order() -> list[str]:
    tree = ast.parse((REPO / "tests/unit/test_layering.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ORDER" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("tests/unit/test_layering.py has no ORDER")


def package_map() -> list[tuple[str, str]]:
    """DESIGN section 2's rows: (room path, what it owns)."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text[text.index("## 2. Package layout"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"^\| `(miles_disagg/[^`]*)` \| (.*) \|$", section, re.M)


def test_design_package_map_matches_the_tree() -> None:
    rows = package_map()
    rooms = [Path(path).stem if path.endswith(".py") else Path(path).name for path, _ in rows]
    assert rooms == _layering_order(), "DESIGN's package map lists the rooms in tests/unit/test_layering.py's ORDER"
    package = REPO / "miles_disagg"
    tree_rooms = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    tree_rooms |= {p.name for p in package.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert tree_rooms == set(rooms), f"rooms not in the map: {sorted(tree_rooms - set(rooms))}; " \
                                     f"in the map, not in the tree: {sorted(set(rooms) - tree_rooms)}"
    problems = []
    for path, owns in rows:
        room = REPO / path
        if not room.is_dir():
            continue
        named = set(re.findall(r"`([\w/]+(?:\.py|/))`", owns))
        problems += [f"{path}: {name} does not exist" for name in sorted(named) if not (room / name).exists()]
        subrooms = {p.name + "/" for p in room.iterdir() if p.is_dir() and any(p.glob("*.py"))}
        problems += [f"{path}: sub-room {name} is not in the map" for name in sorted(subrooms - named)]
        modules = {m.relative_to(room).as_posix() for m in room.rglob("*.py") if m.name != "__init__.py"}
        problems += [f"{path}: module {name} is not in the map" for name in sorted(modules - named)]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------- commands

QUICK = ["--num-rollout", "2", "--rollout-batch-size", "4", "--global-batch-size", "32", "--micro-batch-size", "16"]
"""Two tiny steps: a training command's quick variant."""

FAST = {"--print-config", "--dry-run", "--help"}
"""A training command with one of these starts nothing: it runs as shown."""

PLACEHOLDERS = {"DIR": "/tmp/placeholder-dir", "STORE": "/tmp/placeholder-store", "K": "placeholder-key",
                "N": "1", "BASE": "/tmp/placeholder-base", "NEW": "/tmp/placeholder-new", "S": "/tmp/placeholder-s",
                "L": "/tmp/placeholder-l"}


def _train_argv(argv: list[str]) -> list[str] | None:
    """The ``train*.py`` part of a command line (after ``python``), or None."""
    for i, token in enumerate(argv):
        if token.endswith(("train.py", "train_async.py")) and i > 0 and argv[i - 1].startswith("python"):
            return argv[i:]
    return None


def _is_cluster_line(argv: list[str]) -> bool:
    return argv[0] == "ray" or any(t.startswith("RAY_ADDRESS=") for t in argv[:1]) or "..." in argv


def _kind(argv: list[str]) -> str | None:
    train = _train_argv(argv)
    if train:
        return "cluster" if _is_cluster_line(argv) or "--rollout-service-url" in train else "train"
    if argv[0] == "miles-disagg":
        return "miles-disagg"
    if argv[0].startswith("./scripts/"):
        return "script"
    if argv[0] == "ray":
        return "ray"  # Ray's own command (ray start ...): nothing of ours to check
    return None


def _shown(kind: str) -> list[list[str]]:
    found = []
    for _, argv in all_commands():
        if _kind(argv) != kind:
            continue
        if kind in ("train", "cluster"):
            found.append(_train_argv(argv))
        elif kind == "miles-disagg":
            if "..." not in argv:
                found.append(argv[1:])
        else:
            found.append(argv)
    return found


def _shape(argv: list[str]) -> tuple:
    """What makes two training commands the same check: the entry point, its --config and its flags."""
    config = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    return Path(argv[0]).name, config, tuple(sorted({t for t in argv[1:] if t.startswith("--")}))


def train_shapes() -> list[list[str]]:
    """Each distinct training command of all pages, once (the first page's form)."""
    seen, shapes = set(), []
    for argv in _shown("train"):
        if _shape(argv) not in seen:
            seen.add(_shape(argv))
            shapes.append(argv)
    return shapes


def test_every_command_shown_is_checked() -> None:
    unknown = [f"{page}: {shlex.join(argv)}" for page, argv in all_commands() if _kind(argv) is None]
    assert not unknown, "commands this test does not know how to check (teach it):\n" + "\n".join(unknown)
    for kind in ("train", "cluster", "miles-disagg", "script"):
        assert _shown(kind), kind


def test_whole_runs_stay_few() -> None:
    runs = [argv for argv in train_shapes() if not FAST & set(argv) and run_here(argv)]
    assert len(runs) <= MAX_WHOLE_RUNS, (
        f"the pages show {len(runs)} distinct training runs (at most {MAX_WHOLE_RUNS}: each costs a whole run "
        f"in the suite); show a variant as flags in prose, or reuse a command shown elsewhere: "
        + "; ".join(shlex.join(a) for a in runs))


@pytest.fixture(scope="module")
def base_copy(digits_base_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("readme") / "base-model"
    shutil.copytree(digits_base_model, target)
    return target


def _env() -> dict[str, str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def run_here(argv: list[str]) -> bool:
    """Whether this test runs a shown training command itself: not when a whole-run test runs it
    (``documented_runs.RUN_BY``)."""
    return shlex.join(argv) not in RUN_BY


def test_commands_run_elsewhere_are_shown_and_run_by_their_test() -> None:
    """Every command of ``RUN_BY`` is a command the pages show, and its test builds its command line
    from it with ``documented_argv`` (which fails that test when the pages stop showing it)."""
    import ast

    shown = {shlex.join(argv) for argv in train_shapes()}
    for command, test_file in RUN_BY.items():
        assert command in shown, f"{command!r} (run by {test_file}) is not a command the pages show"
        tree = ast.parse((REPO / test_file).read_text())
        strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        calls = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert command in strings and "documented_argv" in calls, f"{test_file} does not run {command!r}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("argv", [a for a in train_shapes() if run_here(a)], ids=lambda argv: " ".join(argv))
def test_train_commands_run(argv: list[str], base_copy: Path, tmp_path: Path) -> None:
    if "--help" in argv:
        result = _run([sys.executable, *argv], timeout=scaled(120))
        assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-2000:]
        return
    quick = [] if FAST & set(argv) else [*QUICK, "--run-dir", str(tmp_path / "run")]
    result = _run([sys.executable, *argv, "--hf-checkpoint", str(base_copy), *quick], timeout=scaled(600))
    assert result.returncode == 0, f"{shlex.join(argv)} exited {result.returncode}:\n{result.stderr[-4000:]}"
    if "--dry-run" in argv:
        assert isinstance(json.loads(result.stdout), dict)
    elif "--print-config" in argv:
        batch = _value(argv, "--rollout-batch-size")
        assert batch is None or f"rollout_batch_size: {batch}" in result.stdout
    else:
        assert (tmp_path / "run" / "report.png").exists() and (tmp_path / "run" / "summary.json").exists()
        assert "Token authentication is enabled" not in result.stderr


def test_cluster_and_service_commands_parse() -> None:
    from miles_disagg.config.loader import build_parser

    for argv in _shown("cluster"):
        entry = Path(argv[0]).stem
        _, unknown = build_parser(entry).parse_known_args([a for a in argv[1:] if a != "..."])
        assert not unknown, f"{shlex.join(argv)}: {unknown}"


def _substituted(argv: list[str]) -> list[str]:
    out = []
    for token in argv:
        token = token.strip("[]")
        if "|" in token and not token.startswith("http"):
            token = token.split("|")[0]
        if token and token != "...":
            out.append(PLACEHOLDERS.get(token, token))
    return out


def test_miles_disagg_commands_parse() -> None:
    from miles_disagg.cli import build_parser

    for argv in _shown("miles-disagg"):
        args = _substituted(argv)
        build_parser(args).parse_args(args)  # ConfigError naming the flag if a page is wrong


def test_the_weights_chain_runs_on_a_tiny_model(tmp_path: Path) -> None:
    """``weights publish / apply / verify / inspect`` as the pages show them, placeholders filled."""
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    base, new = tmp_path / "base", tmp_path / "new"
    make_tiny_qwen3(base, seed=1)
    make_tiny_qwen3(new, seed=2)
    values = {"BASE": str(base), "NEW": str(new), "S": str(tmp_path / "store"), "L": str(tmp_path / "local"), "N": "1"}
    chain = [argv for argv in _shown("miles-disagg") if argv[0] == "weights"]
    assert [argv[1] for argv in chain] == ["publish", "apply", "verify", "inspect"]
    for argv in chain:
        args = [values.get(t.strip("[]"), t.strip("[]")) for t in argv]
        result = _run([sys.executable, "-m", "miles_disagg.cli", *args], timeout=scaled(300))
        assert result.returncode == 0, f"miles-disagg {shlex.join(args)}:\n{result.stderr[-3000:]}"


def test_scripts_shown_are_known() -> None:
    scripts = _shown("script")
    assert ["./scripts/demo.sh"] in scripts and ["./scripts/test.sh"] in scripts
    others = [argv for argv in scripts if argv[0] not in ("./scripts/demo.sh", "./scripts/test.sh")]
    assert not others, f"scripts this test does not run: {others}"
    assert [argv for argv in scripts if argv[0] == "./scripts/demo.sh"] == [["./scripts/demo.sh"]]


def test_test_script_variants_use_known_pytest_options() -> None:
    """``./scripts/test.sh ARGS`` hands ARGS to pytest: a marker shown must be a registered one."""
    import tomllib

    markers = {m.split(":")[0] for m in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]
               ["ini_options"]["markers"]}
    for argv in _shown("script"):
        if argv[0] != "./scripts/test.sh":
            continue
        args = argv[1:]
        assert set(args) - {"-m"} <= markers | {"not", "and", "or"}, f"{shlex.join(argv)}: unknown pytest options"
        if "-m" in args:
            assert all(word in markers | {"not", "and", "or"} for word in args[args.index("-m") + 1].split())


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_test_script_collects_the_suite() -> None:
    env = {**_env(), "MILES_DISAGG_TEST_WORKERS": "1"}
    # the e2e and integration modules left out: collecting them imports megatron and the rest once more,
    # for nothing this check needs (CI runs the script whole)
    result = subprocess.run(["./scripts/test.sh", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "--ignore=tests/e2e", "--ignore=tests/integration"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=scaled(900))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    main, _, tier = result.stdout.partition("== the SGLang conformance tier (tests/sglang) ==")
    assert "tests/unit/test_layering.py::" in main and "tests/sglang/" not in main, main[-2000:]
    assert "tests/sglang/" in tier, tier[-2000:]  # the tier, in its own process
