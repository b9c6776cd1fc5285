"""Issue 14 on the store and the launchers, through ``miles-disagg weights`` and the real start-up code.

Malformed store files are refused in one line (exit 2) without touching anything; ``verify``
never inflates a payload past what the base layout allows; a killed publisher's staging dir is
gone at the next publish; Ray clusters this project starts keep token authentication on and
``serve ray`` starts no dashboard.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from test_weights_cli import cli, make_target, ok
from weights_fixtures import write_foreign_version

pytestmark = pytest.mark.timeout(300)

DEEP = b"[" * 100_000 + b"]" * 100_000


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def refused_one_line(*args: str, match: str) -> str:
    proc = cli(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("[miles-disagg ")]  # progress
    assert len(lines) == 1 and "Traceback" not in proc.stderr and match in lines[0], proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_qwen3_dir):
    root = tmp_path_factory.mktemp("store-security")
    target = make_target(tiny_qwen3_dir, root / "t1", 1)
    ok("publish", "--base-dir", str(tiny_qwen3_dir), "--target-dir", str(target), "--store", str(root / "store"),
       "--run-id", "r")
    return root / "store"


def _index(store: Path) -> Path:
    return store / "weight_v000001" / "model.safetensors.index.json"


def _payload(store: Path) -> Path:
    return next((store / "weight_v000001").glob("*.safetensors"))


def _header_file(raw: bytes) -> bytes:
    return len(raw).to_bytes(8, "little") + raw


MALFORMED_FILES = [
    ("index nested too deep", _index, b'{"metadata": ' + DEEP + b"}", "nested too deeply"),
    ("index with a lone surrogate", _index, b'{"metadata": {"version": "\\ud800"}, "weight_map": {}}', "UTF-8"),
    ("index not UTF-8", _index, b'{"metadata": {"version": "\xff"}}', "not valid"),
    ("index with wrong types", _index,
     b'{"metadata": {"version": [1], "base_version": "0", "delta_encoding": "xor", "compression_format": "zstd",'
     b' "checksum_format": "xxh3-128", "run_id": "r"}, "weight_map": {}}', "not a version number"),
    ("index with a negative layout", _index,
     b'{"metadata": {"version": "1", "base_version": "0", "delta_encoding": "xor", "compression_format": "zstd",'
     b' "checksum_format": "xxh3-128", "run_id": "r", "tensors": {"w": {"dtype": "F32", "shape": [-4],'
     b' "nbytes": 16}}}, "weight_map": {}}', "negative size"),
    ("LATEST nested too deep", lambda s: s / "LATEST", DEEP, "nested too deeply"),
    ("LATEST with wrong types", lambda s: s / "LATEST", b'{"run_id": 5, "version": "1"}', "malformed"),
    ("LATEST with an infinite version", lambda s: s / "LATEST", b'{"run_id": "r", "version": 1e999}', "malformed"),
    ("payload header nested too deep", _payload, _header_file(DEEP), "nested too deeply"),
    ("payload header with wrong types", _payload, _header_file(b'{"w": {"dtype": "U8", "shape": "x"}}'), "malformed"),
]


# short ids: a test's id travels in PYTEST_CURRENT_TEST to every process it starts, and one
# environment string may not exceed 128 KiB
@pytest.mark.parametrize("case, file_of, content, match", MALFORMED_FILES, ids=[c[0] for c in MALFORMED_FILES])
def test_a_malformed_store_file_is_one_line_exit_2_and_changes_nothing(store, tmp_path, tiny_qwen3_dir, case,
                                                                     file_of, content, match):
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    file_of(copy).write_bytes(content)
    before = files_of(copy)
    refused_one_line("verify", "--store", str(copy), match=match)
    refused_one_line("apply", "--store", str(copy), "--base-dir", str(tiny_qwen3_dir), "--local-dir",
                     str(tmp_path / "host"), match=match)
    assert files_of(copy) == before
    assert not (tmp_path / "host").exists() or not any((tmp_path / "host").iterdir())


def test_verify_bounds_a_plain_version_by_the_base_layout(tmp_path, tiny_qwen3_dir):
    """A 'zip bomb': a small xor payload that would inflate to 64 MiB for a tensor of a few KiB."""
    import numpy as np
    import zstandard

    store = tmp_path / "foreign"
    base = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    name = "model.norm.weight"
    changed = dict(base)
    changed[name] = base[name] + 1.0
    vdir = write_foreign_version(store, 1, base, changed)  # a plain-format version (no sizes recorded)
    payload = next(vdir.glob("*.safetensors"))
    bomb = np.frombuffer(zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20)), dtype=np.uint8)
    from safetensors.numpy import load_file as load_np, save_file as save_np

    tensors = load_np(str(payload))
    tensors[name] = bomb
    save_np(tensors, str(payload), metadata={name: "0" * 32})
    assert payload.stat().st_size < 64 << 10
    before = files_of(store)
    refused_one_line("verify", "--store", str(store), match="--base-dir")
    refused_one_line("verify", "--store", str(store), "--base-dir", str(tiny_qwen3_dir),
                     match="more than the local tensor allows")
    assert files_of(store) == before


KILLED_PUBLISHER = """
import sys, time
from miles_disagg.weights.store import VersionStore
staging = VersionStore(sys.argv[1]).new_staging_dir(2)
(staging / "model-00000-of-00001.safetensors").write_bytes(b"half written")
print(staging, flush=True)
time.sleep(600)
"""


def test_a_killed_publishers_staging_dir_is_removed_at_the_next_publish(store, tmp_path, tiny_qwen3_dir):
    from miles_disagg.weights.store import VersionStore

    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PUBLISHER, str(copy)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    orphan = Path(proc.stdout.readline().strip())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    live_store = VersionStore(copy)
    live = live_store.new_staging_dir(9)  # another publisher, alive, mid-write
    try:
        assert orphan.is_dir()
        target = make_target(tiny_qwen3_dir, tmp_path / "t2", 2)
        ok("publish", "--base-dir", str(tiny_qwen3_dir), "--target-dir", str(target), "--store", str(copy))
        assert not orphan.exists(), "the dead publisher's staging dir outlived the next publish"
        assert live.is_dir(), "a live publisher's staging dir was swept"
        assert not (copy / "weight_v000002" / ".owner").exists()
    finally:
        shutil.rmtree(live, ignore_errors=True)
        live_store.release_staging(live)


# --------------------------------------------------------------------------- Ray


class _Stop(Exception):
    pass


def _record_ray_init(monkeypatch) -> list[tuple[str | None, dict]]:
    import ray

    calls: list[tuple[str | None, dict]] = []

    def fake_init(*args, **kwargs):
        calls.append((os.environ.get("RAY_AUTH_MODE"), {**kwargs, "environ": dict(os.environ)}))
        raise _Stop()

    from miles_disagg.net.netbind import LOCAL_RAY_ENV, WORKER_ENV

    for name in (LOCAL_RAY_ENV, *WORKER_ENV):  # whatever the launcher sets there is undone after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    return calls


def test_the_launcher_keeps_ray_token_auth_on_and_hands_actors_the_run_keys(monkeypatch):
    from miles_disagg.net.auth import ADMIN_API_KEY_ENV
    from miles_disagg.loop.ray_start import init_ray

    calls = _record_ray_init(monkeypatch)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv(ADMIN_API_KEY_ENV, "the-run-key")
    with pytest.raises(_Stop):
        init_ray(2)
    mode, kwargs = calls[-1]
    # never disabled: unset here (Ray is imported), so Ray >= 2.60 turns token auth on by itself
    assert mode is None and kwargs["include_dashboard"] is False
    # the local Ray's raylet, and so every actor, inherits the keys and one OpenMP thread per worker
    assert "runtime_env" not in kwargs
    environ = kwargs["environ"]
    assert environ[ADMIN_API_KEY_ENV] == "the-run-key" and environ["OMP_NUM_THREADS"] == "1"
    assert environ["MILES_DISAGG_LOCAL_RAY"] == "1"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a test's own local cluster may opt out
    with pytest.raises(_Stop):
        init_ray(2)
    assert calls[-1][0] == "disabled"


def test_serve_ray_starts_no_dashboard_and_keeps_token_auth(monkeypatch, tmp_path):
    import threading

    from miles_disagg.service.ray_pool import RayServiceConfig, run_ray_service

    calls = _record_ray_init(monkeypatch)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    config = RayServiceConfig(store_dir=tmp_path, base_dir=tmp_path, work_dir=tmp_path)
    with pytest.raises(_Stop):
        run_ray_service(config, address=None, stop=threading.Event())
    mode, kwargs = calls[-1]
    # never disabled: unset here (Ray is imported), so Ray >= 2.60 turns token auth on by itself
    assert mode is None and kwargs["include_dashboard"] is False
