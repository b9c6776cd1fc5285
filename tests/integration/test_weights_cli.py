"""``miles-disagg weights ...`` as a subprocess: exit codes, one-line errors, store/local state."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import scaled
import torch
from safetensors.torch import load_file, save_file

from weights_fixtures import fingerprint, make_target

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "miles_disagg.cli", "weights", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=scaled(300))


def ok(*args: str) -> dict:
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def refused(*args: str, match: str) -> str:
    proc = cli(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and match in proc.stderr, proc.stderr
    return proc.stderr


@pytest.fixture(scope="module")
def published(tmp_path_factory, tiny_qwen3_dir):
    root = tmp_path_factory.mktemp("cli")
    base = tiny_qwen3_dir
    t1 = make_target(base, root / "t1", 1)
    t2 = make_target(base, root / "t2", 2, source=t1)
    store = root / "store"
    first = ok("publish", "--base-dir", str(base), "--target-dir", str(t1), "--store", str(store), "--run-id", "cli-run")
    second = ok("publish", "--base-dir", str(base), "--target-dir", str(t2), "--store", str(store),
                "--encoding", "overwrite", "--filter", "none", "--checksum", "blake3")
    return root, base, store, (first, second), (t1, t2)


def test_publish_apply_verify_inspect(published):
    root, base, store, (first, second), (t1, t2) = published
    assert (first["version"], first["base_version"], first["run_id"]) == (1, 0, "cli-run")
    assert (second["version"], second["delta_encoding"], second["run_id"]) == (2, "overwrite", "cli-run")
    assert 0 < first["density"] < 1 and first["wire_bytes"] > 0

    local = root / "host"
    applied = ok("apply", "--store", str(store), "--base-dir", str(base), "--local-dir", str(local), "--to-version", "1")
    assert applied["version"] == 1 and applied["previous"] is None
    applied = ok("apply", "--store", str(store), "--base-dir", str(base), "--local-dir", str(local))
    assert applied["version"] == 2 and applied["previous"] == 1
    want = load_file(str(t2 / "model.safetensors"))
    got = load_file(str(local / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (local / name).read_bytes() == (base / name).read_bytes()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(local))
    AutoTokenizer.from_pretrained(str(local))
    name = next(k for k in want if ".mlp." in k)
    assert torch.equal(model.state_dict()[name], want[name])

    report = ok("verify", "--store", str(store), "--base-dir", str(base))
    assert report["ok"] and report["chain"] == [1, 2] and report["final_checksums_verified"]
    summary = ok("inspect", "--store", str(store))
    assert summary["latest"] == {"run_id": "cli-run", "version": 2}
    assert [(v["version"], v["base_version"], v["delta_encoding"], v["filter"]) for v in summary["versions"]] == [
        (1, 0, "mixed", "byteplane"), (2, 1, "overwrite", "none")]  # xor + byte planes publishes mixed
    assert all(0 < v["density"] < 1 and v["wire_bytes"] > 0 for v in summary["versions"])


def test_bad_inputs_exit_2_with_one_line_and_change_nothing(published, tmp_path):
    root, base, store, _, (t1, t2) = published
    local = tmp_path / "host"
    ok("apply", "--store", str(store), "--base-dir", str(base), "--local-dir", str(local), "--to-version", "1")
    before = fingerprint(local, store)

    refused("apply", "--store", str(store), "--base-dir", str(base), "--local-dir", str(local), "--to-version", "7",
            match="version 7 is not published")
    refused("publish", "--base-dir", str(base), "--target-dir", str(t1), "--store", str(store), "--encoding", "rle",
            match="invalid choice")
    refused("publish", "--base-dir", str(base), "--target-dir", str(t1), "--store", str(store), "--run-id", "other",
            match="holds run 'cli-run'")
    refused("publish", "--base-dir", str(base), "--target-dir", str(tmp_path / "nope"), "--store", str(store),
            match="is not a directory")
    refused("publish", "--base-dir", str(base), "--target-dir", str(t1), "--store", str(store),
            "--post-write-hook", "no_such_mod:fn", match="--custom-update-weight-post-write-path")
    assert fingerprint(local, store) == before

    # corrupt version 2 in a copy of the store: apply and verify refuse, nothing moves
    bad_store = tmp_path / "bad_store"
    shutil.copytree(store, bad_store)
    vdir = bad_store / "weight_v000002"
    payload = next(vdir.glob("*.safetensors"))
    payload.write_bytes(payload.read_bytes()[:-40])
    before = fingerprint(local, bad_store)
    refused("apply", "--store", str(bad_store), "--base-dir", str(base), "--local-dir", str(local), match="truncated")
    refused("verify", "--store", str(bad_store), match="truncated")
    assert fingerprint(local, bad_store) == before

    index = json.loads((vdir / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "../../escape.safetensors" for k in index["weight_map"]}
    (vdir / "model.safetensors.index.json").write_text(json.dumps(index))
    refused("apply", "--store", str(bad_store), "--base-dir", str(base), "--local-dir", str(local),
            match="outside the version directory")
    assert fingerprint(local, bad_store) == before


def test_a_store_in_the_plain_format_of_another_producer(published, tmp_path):
    """A store miles wrote (no LATEST, no additions, payloads from two ranks) through the CLI."""
    from weights_fixtures import write_foreign_version

    root, base, store, _, (t1, t2) = published
    foreign = tmp_path / "miles-store"
    states = [load_file(str(d / "model.safetensors")) for d in (base, t1, t2)]
    write_foreign_version(foreign, 1, states[0], states[1], ranks=2)
    write_foreign_version(foreign, 2, states[1], states[2], encoding="overwrite", checksum_format="adler32", ranks=2)
    local = tmp_path / "host"
    applied = ok("apply", "--store", str(foreign), "--base-dir", str(base), "--local-dir", str(local))
    assert (applied["version"], applied["run_id"]) == (2, "")
    got = load_file(str(local / "model.safetensors"))
    assert all(torch.equal(got[k], states[2][k]) for k in states[2])
    report = ok("verify", "--store", str(foreign), "--base-dir", str(base))
    assert report["chain"] == [1, 2] and report["final_checksums_verified"]
    summary = ok("inspect", "--store", str(foreign))
    assert summary["latest"] is None
    assert [(v["version"], v["base_version"], v["foreign"], v["files"]) for v in summary["versions"]] == [
        (1, 0, True, 2), (2, 1, True, 2)]
    before = fingerprint(local, foreign)
    (foreign / "weight_v000002" / "model-00001-of-00002.safetensors").unlink()
    refused("verify", "--store", str(foreign), "--base-dir", str(base), match="missing")
    refused("verify", "--store", str(foreign), match="give --base-dir")  # no sizes recorded: nothing to bound by
    refused("apply", "--store", str(foreign), "--base-dir", str(base), "--local-dir", str(local), "--to-version", "1",
            match="never applied twice")
    assert fingerprint(local, foreign) == before


def test_verify_without_a_base_checks_what_apply_checks_and_a_failed_apply_leaves_no_slot(published, tmp_path):
    """A sparse payload relabelled ``overwrite`` in the index: ``apply`` refuses it, and so must
    ``verify`` without ``--base-dir`` (it decodes every payload as apply does); the refused apply
    leaves no scratch slot behind and the held version held."""
    root, base, store, _, (t1, t2) = published
    t3 = tmp_path / "t3"
    shutil.copytree(t2, t3)
    tensors = load_file(str(t2 / "model.safetensors"))
    name = next(k for k in sorted(tensors) if ".mlp." in k)
    changed = tensors[name].clone()
    changed.view(-1)[:3] += 1.0  # three elements of one tensor: published sparse
    save_file({**tensors, name: changed}, str(t3 / "model.safetensors"), metadata={"format": "pt"})
    relabelled = tmp_path / "store"
    shutil.copytree(store, relabelled)
    ok("publish", "--base-dir", str(base), "--target-dir", str(t3), "--store", str(relabelled))
    vdir = relabelled / "weight_v000003"
    index = json.loads((vdir / "model.safetensors.index.json").read_text())
    entry = index["metadata"]["tensors"][name]
    assert entry["encoding"] == "sparse", entry
    entry["encoding"] = "overwrite"
    (vdir / "model.safetensors.index.json").write_text(json.dumps(index))

    local = tmp_path / "host"
    ok("apply", "--store", str(relabelled), "--base-dir", str(base), "--local-dir", str(local), "--to-version", "2")
    before = fingerprint(local, relabelled)
    refused("apply", "--store", str(relabelled), "--base-dir", str(base), "--local-dir", str(local),
            match="overwrite")
    assert sorted(p.name for p in (tmp_path / "host.slots").iterdir() if not p.name.startswith(".")) == [
        "a", "state.json"], "the refused apply left its scratch slot"
    assert fingerprint(local, relabelled) == before
    refused("verify", "--store", str(relabelled), match="overwrite")
    refused("verify", "--store", str(relabelled), "--base-dir", str(base), match="overwrite")
