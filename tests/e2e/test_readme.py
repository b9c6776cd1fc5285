"""The README stands alone and says what the code does.

* every link and repository path it names exists in a clone (no ``../shared``);
* every ``--flag`` it names is a flag of ``train.py``/``train_async.py`` or of a ``miles-disagg``
  command, a refused miles flag, the ``--sglang-*`` passthrough, or one of the few flags of the
  other tools it shows (Ray, pytest, pip, SGLang, ``scripts/gpu_check.sh``);
* every command in its ``bash`` code blocks runs: ``train.py``/``train_async.py`` lines as a user
  types them (``--print-config`` and ``--dry-run`` as shown; the training runs shortened to two tiny
  steps), ``./scripts/demo.sh`` (two steps) and ``./scripts/test.sh`` (collection only); the
  ``miles-disagg weights`` chain on a tiny model; every other ``miles-disagg`` line is parsed by
  the command's own parser (servers are not left running); cluster lines (``ray ...``, a remote
  ``RAY_ADDRESS``) have their ``train*.py`` flags parsed.

Commands are read from the code blocks generally, so sections other people add are checked too.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

OTHER_TOOLS_FLAGS = {
    # ray start / ray job submit (section "Running on a cluster")
    "--head", "--num-gpus", "--dashboard-port", "--dashboard-host", "--resources", "--working-dir",
    "--dist", "--strict-markers",  # pytest (section "Development")
    "--no-deps",  # pip (the SGLang tier)
    "--enable-memory-saver",  # SGLang's own flag, which managed colocated engines get
    "--ep-size",  # SGLang's own flag, which --sglang-ep-size becomes
    "--generate",  # ray get-auth-token --generate
    "--no-x",  # the README's example of the boolean pattern (--x / --no-x)
    "--prot", "--rollout-batch-sise",  # typos in the README's "did you mean" examples
}
GPU_CHECK_FLAGS = {"--cpu", "--only"}  # scripts/gpu_check.sh (miles_disagg/bench/gpu_check.py)
PATH_PREFIXES = ("configs/", "scripts/", "miles_disagg/", "tests/", "docs/", ".ci/")
ROOT_FILES = ("train.py", "train_async.py", "pyproject.toml")


def readme() -> str:
    return README.read_text(encoding="utf-8")


def code_blocks(text: str, languages: tuple[str, ...] = ("bash",)) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M) if m.group(1) in languages]


def commands(text: str) -> list[list[str]]:
    """Every command line of the README's bash blocks (continuations joined, comments dropped)."""
    found = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                found.append(argv)
    return found


def all_known_flags() -> set[str]:
    from miles_disagg.cli import SUBCOMMANDS, _option_strings, build_parser
    from miles_disagg.config.loader import build_parser as build_run_parser

    flags = set()
    for entry in ("train", "train_async"):
        flags |= set(_option_strings(build_run_parser(entry)))
    for name in SUBCOMMANDS:
        flags |= set(_option_strings(build_parser([name])))
    return flags


def test_links_and_paths_exist_in_the_repository() -> None:
    text = readme()
    assert "../shared" not in text, "the README must link only files a clone has"
    anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.*)$", text, re.M)}
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        if target.startswith("#"):
            assert target[1:] in anchors, f"README links {target}: no such section"
            continue
        assert (REPO / target.split("#")[0]).exists(), f"README links {target}: not in the repository"
    for m in re.finditer(r"`([^`\s]+)`", text):
        if text[max(m.start() - 7, 0):m.start()] == "miles' ":
            continue  # a file of miles' repository
        path = m.group(1).rstrip(".,:;)")
        if path.startswith(PATH_PREFIXES) or path in ROOT_FILES:
            if any(c in path for c in "*{<"):
                continue
            assert (REPO / path).exists(), f"README names {path}: not in the repository"
    for doc in (REPO / "docs").rglob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text(encoding="utf-8")):
            if not target.startswith(("http", "/")):
                assert (doc.parent / target).exists(), f"{doc.relative_to(REPO)} links {target}: missing"


def test_every_flag_the_readme_names_exists() -> None:
    from miles_disagg.config.miles_flags import REFUSED_FLAGS

    text = readme()
    known = all_known_flags() | set(REFUSED_FLAGS) | OTHER_TOOLS_FLAGS
    gpu_check = (REPO / "miles_disagg/bench/gpu_check.py").read_text()
    assert all(f'"{flag}"' in gpu_check for flag in GPU_CHECK_FLAGS)
    missing = set()
    for m in re.finditer(r"(?<![\w-])--[a-z0-9][a-z0-9-]*[a-z0-9]", text):
        flag, following = m.group(), text[m.end():m.end() + 1]
        if following in ("*", "-") or flag.startswith("--sglang-") or flag in GPU_CHECK_FLAGS:
            continue  # a family (--eval-*), or the --sglang-* passthrough
        if flag not in known:
            missing.add(flag)
    assert not missing, f"the README names flags nothing takes: {sorted(missing)}"


# ---------------------------------------------------------------------------------------- commands

QUICK = ["--num-rollout", "2", "--rollout-batch-size", "4", "--global-batch-size", "32", "--micro-batch-size", "16"]
"""Two tiny steps: a training command's quick variant."""

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


def _shown(kind: str) -> list[list[str]]:
    found = []
    for argv in commands(readme()):
        train = _train_argv(argv)
        if kind == "train" and train and not _is_cluster_line(argv) and "--rollout-service-url" not in train:
            found.append(train)
        elif kind == "cluster" and train and (_is_cluster_line(argv) or "--rollout-service-url" in train):
            found.append(train)
        elif kind == "miles-disagg" and argv[0] == "miles-disagg" and "..." not in argv:
            found.append(argv[1:])
        elif kind == "script" and argv[0].startswith("./scripts/"):
            found.append(argv)
    return found


def test_the_readme_shows_commands_of_every_kind() -> None:
    for kind in ("train", "cluster", "miles-disagg", "script"):
        assert _shown(kind), kind
    assert len(_shown("train")) <= 8, "raise test_train_commands_run's range: every train command must run"


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


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("index", range(8))
def test_train_commands_run(index: int, base_copy: Path, tmp_path: Path) -> None:
    shown = _shown("train")
    if index >= len(shown):
        pytest.skip(f"the README shows {len(shown)} train commands")
    argv = shown[index]
    quick = [] if {"--print-config", "--dry-run"} & set(argv) else [*QUICK, "--run-dir", str(tmp_path / "run")]
    result = _run([sys.executable, *argv, "--hf-checkpoint", str(base_copy), *quick], timeout=600)
    assert result.returncode == 0, f"{shlex.join(argv)} exited {result.returncode}:\n{result.stderr[-4000:]}"
    if "--dry-run" in argv:
        import json

        assert isinstance(json.loads(result.stdout), dict)
    elif "--print-config" in argv:
        assert "rollout_batch_size: 16" in result.stdout
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
        build_parser(args).parse_args(args)  # ConfigError naming the flag if the README is wrong


def test_the_weights_chain_runs_on_a_tiny_model(tmp_path: Path) -> None:
    """``weights publish / apply / verify / inspect`` as the README shows them, placeholders filled."""
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    base, new = tmp_path / "base", tmp_path / "new"
    make_tiny_qwen3(base, seed=1)
    make_tiny_qwen3(new, seed=2)
    values = {"BASE": str(base), "NEW": str(new), "S": str(tmp_path / "store"), "L": str(tmp_path / "local"), "N": "1"}
    chain = [argv for argv in _shown("miles-disagg") if argv[0] == "weights"]
    assert [argv[1] for argv in chain] == ["publish", "apply", "verify", "inspect"]
    for argv in chain:
        args = [values.get(t.strip("[]"), t.strip("[]")) for t in argv]
        result = _run([sys.executable, "-m", "miles_disagg.cli", *args], timeout=300)
        assert result.returncode == 0, f"miles-disagg {shlex.join(args)}:\n{result.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_demo_script_runs(tmp_path: Path, base_copy: Path) -> None:
    scripts = [argv for argv in _shown("script") if argv[0] == "./scripts/demo.sh"]
    assert scripts == [["./scripts/demo.sh"]]
    result = _run(["./scripts/demo.sh", *QUICK, "--hf-checkpoint", str(base_copy), "--run-dir", str(tmp_path / "run")],
                  timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "== run summary" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_test_script_collects_the_suite() -> None:
    scripts = [argv for argv in _shown("script") if argv[0] == "./scripts/test.sh"]
    assert scripts == [["./scripts/test.sh"]]
    env = {**_env(), "MILES_DISAGG_TEST_WORKERS": "1"}
    result = subprocess.run(["./scripts/test.sh", "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "tests collected" in result.stdout or "collected" in result.stdout
