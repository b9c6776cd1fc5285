"""The version store on a real S3-API server (moto in server mode, tests/s3_server.py): round trips
against the directory store, racing publishers, publishers killed mid-commit, hostile objects, and
faults the server cannot make (through the fault-injecting proxy of miles_disagg/bench/wan_proxy.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import pytest
from safetensors.torch import load_file

from deadlines import scaled
from object_store_helpers import PAYLOAD_NAME, commit_next, stage_version
from s3_fixtures import s3_bucket, s3_env, s3_server  # noqa: F401 - fixtures
from weights_fixtures import fingerprint, make_target

from miles_disagg.types import PublishConflict, VersionRef
from miles_disagg.weights.audit import verify_version
from miles_disagg.weights.checksums import checksum
from miles_disagg.weights.materializer import Materializer
from miles_disagg.weights.object_layout import POINTER_KEY
from miles_disagg.weights.publisher import DeltaPublisher
from miles_disagg.weights.stores import open_store

REPO = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parents[1] / "object_store_helpers.py"


def s3(server):
    return boto3.client("s3", endpoint_url=server.url, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_disagg.cli", "weights", *args], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True, text=True,
                          timeout=scaled(300))


def publish_chain(store: str, base: Path, targets: list[Path], run_id: str, anchor_interval: int = 0) -> None:
    publisher = DeltaPublisher(store, base_dir=base, run_id=run_id, full_anchor_interval=anchor_interval)
    try:
        publisher.capture_baseline()
        for target in targets:
            publisher.publish(load_file(str(target / "model.safetensors")).items())
    finally:
        publisher.close()


@pytest.fixture(scope="module")
def targets(tmp_path_factory, tiny_qwen3_dir):
    root = tmp_path_factory.mktemp("targets")
    chain = [make_target(tiny_qwen3_dir, root / "t1", 1)]
    for seed in (2, 3):
        chain.append(make_target(tiny_qwen3_dir, root / f"t{seed}", seed, source=chain[-1]))
    return chain


def test_round_trips_equal_the_directory_store(s3_bucket, s3_env, tiny_qwen3_dir, targets, tmp_path):
    server, bucket = s3_bucket
    url = f"s3://{bucket}/run1"
    publish_chain(str(tmp_path / "dir-store"), tiny_qwen3_dir, targets, "same-run", anchor_interval=2)
    publish_chain(url, tiny_qwen3_dir, targets, "same-run", anchor_interval=2)
    directory, objects = open_store(tmp_path / "dir-store"), open_store(url, cache_dir=tmp_path / "reader-cache")
    assert objects.visible_versions() == directory.visible_versions() == [2, 3]  # v2 is an anchor: v1 pruned
    assert not [k for k in _keys(s3_bucket) if "weight_v000001/" in k]  # and its objects deleted
    for version in (2, 3):
        a, b = directory.read_index(version), objects.read_index(version)
        assert (a.delta_encoding, a.layouts, sorted(a.weight_map)) == (b.delta_encoding, b.layouts, sorted(b.weight_map))
        assert verify_version(objects, version, tiny_qwen3_dir)["final_checksums_verified"]
        held = {}
        for name, store in (("dir", str(tmp_path / "dir-store")), ("s3", url)):
            local = tmp_path / f"host-{name}-{version}"
            prepared = Materializer(local, base_dir=tiny_qwen3_dir).prepare(store, version)
            held[name] = (local / "model.safetensors").read_bytes()
            assert prepared.ref == VersionRef("same-run", version)
        assert held["dir"] == held["s3"]
    assert held["s3"] == (targets[-1] / "model.safetensors").read_bytes()


def test_the_cli_publishes_applies_and_lists_an_object_store(s3_bucket, s3_env, tiny_qwen3_dir, targets, tmp_path):
    _, bucket = s3_bucket
    url = f"s3://{bucket}/cli"
    published = cli("publish", "--base-dir", str(tiny_qwen3_dir), "--target-dir", str(targets[0]), "--store", url)
    assert published.returncode == 0, published.stderr
    listed = json.loads(cli("ls", "--store", url).stdout)
    assert listed["latest"]["version"] == 1 and listed["versions"][0]["wire_bytes"] > 0
    applied = cli("apply", "--store", url, "--base-dir", str(tiny_qwen3_dir), "--local-dir", str(tmp_path / "host"))
    assert applied.returncode == 0, applied.stderr
    assert (tmp_path / "host" / "model.safetensors").read_bytes() == (targets[0] / "model.safetensors").read_bytes()
    for scheme in ("gs", "file", "https"):
        refused = cli("publish", "--base-dir", str(tiny_qwen3_dir), "--target-dir", str(targets[0]),
                      "--store", f"{scheme}://{bucket}/x")
        assert refused.returncode == 2 and f"the {scheme}:// scheme is not a version store" in refused.stderr
        assert not (REPO / f"{scheme}:").exists()


def test_two_publishers_racing_for_one_version_leave_one_winner(s3_bucket, s3_env, tmp_path):
    _, bucket = s3_bucket
    url = f"s3://{bucket}/race"
    stores = [open_store(url, cache_dir=tmp_path / f"publisher-{i}") for i in range(2)]
    for race in range(100):
        expected = stores[0].latest()
        ref = VersionRef("race", race + 1)
        staged = [stage_version(store, ref.version, "race", f"{i}-{race}".encode()) for i, store in enumerate(stores)]
        barrier, outcomes = threading.Barrier(2), [None, None]

        def publish(i: int) -> None:
            barrier.wait()
            try:
                stores[i].commit(staged[i], ref, expected)
                outcomes[i] = "won"
            except PublishConflict as exc:
                outcomes[i] = exc

        threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(scaled(60))
        assert sorted(map(str, outcomes)).count("won") == 1, (race, outcomes)
        winner = outcomes.index("won")
        reader = open_store(url, cache_dir=tmp_path / f"reader-{race}")
        assert reader.latest() == ref
        files = reader.version_files(ref.version)
        assert (files / PAYLOAD_NAME).read_bytes() == f"{winner}-{race}".encode()
    assert {k for k in _keys(s3_bucket) if "/weight_v" in f"/{k}"} == set(_referenced(url, tmp_path))


def _keys(s3_bucket) -> list[str]:
    server, bucket = s3_bucket
    paginator = s3(server).get_paginator("list_objects_v2")
    return [item["Key"] for page in paginator.paginate(Bucket=bucket) for item in page.get("Contents", [])]


def _referenced(url: str, tmp_path: Path) -> list[str]:
    """Every object key LATEST's manifests name (manifests and payloads)."""
    store = open_store(url, cache_dir=tmp_path / "referenced")
    pointer = store.read_pointer()
    keys = []
    for manifest in pointer.manifests.values():
        folder = manifest.name.rsplit("/", 1)[0]
        keys += [store.location.key(manifest.name), store.location.key(f"{folder}/{PAYLOAD_NAME}")]
    return keys


def test_a_publisher_killed_at_random_moments_leaves_no_partial_version(s3_bucket, s3_server, tmp_path):
    _, bucket = s3_bucket
    url = f"s3://{bucket}/killed"
    env = {**os.environ, **s3_server.env()}
    rng = random.Random(7)
    for kill in range(20):
        child = subprocess.Popen([sys.executable, str(HELPERS), url, str(tmp_path / "child-cache"), "killed"],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        time.sleep(rng.uniform(0.0, 0.6))
        child.kill()
        child.wait(scaled(30))
    os.environ.update(s3_server.env())
    reader = open_store(url, cache_dir=tmp_path / "reader")
    visible = reader.visible_versions()
    assert visible == list(range(1, len(visible) + 1))
    for version in visible:  # every committed version is whole: its manifest and every object check out
        assert (reader.version_files(version) / PAYLOAD_NAME).stat().st_size == 2 * 1024 * 1024
    reader.sweep()  # attempts no pointer names are garbage at or below LATEST
    assert commit_next(reader, "killed", b"after the kills").version == len(visible) + 1
    orphans = {k for k in _keys(s3_bucket) if "/weight_v" in f"/{k}"} - set(_referenced(url, tmp_path))
    assert all(k.rsplit("/", 2)[0].endswith(f"{len(visible) + 1:06d}") for k in orphans), orphans


@pytest.fixture
def published_v1(s3_bucket, s3_env, tiny_qwen3_dir, targets, tmp_path):
    """Version 1 published, and a host holding it (so a refused v2 must leave v1 held)."""
    _, bucket = s3_bucket
    url = f"s3://{bucket}/hostile"
    publish_chain(url, tiny_qwen3_dir, targets[:2], "hostile")
    host = tmp_path / "host"
    assert cli("apply", "--store", url, "--base-dir", str(tiny_qwen3_dir), "--local-dir", str(host),
               "--to-version", "1").returncode == 0
    store = open_store(url, cache_dir=tmp_path / "inspect")
    manifest = store.read_pointer().manifests[2]
    folder = manifest.name.rsplit("/", 1)[0]
    payloads = [store.location.key(f"{folder}/{f}") for f in store.read_index(2).files()]
    return url, host, store, payloads


def _corrupt(kind: str, server, bucket: str, store, payload: str) -> None:
    client = s3(server)
    if kind == "deleted":
        client.delete_object(Bucket=bucket, Key=payload)
    elif kind == "truncated":
        body = client.get_object(Bucket=bucket, Key=payload)["Body"].read()
        client.put_object(Bucket=bucket, Key=payload, Body=body[: len(body) // 2])
    elif kind == "corrupted":
        body = bytearray(client.get_object(Bucket=bucket, Key=payload)["Body"].read())
        body[len(body) // 2] ^= 0xFF
        client.put_object(Bucket=bucket, Key=payload, Body=bytes(body))
    else:  # a manifest rewritten by whoever controls the store, LATEST's entry made to match it
        pointer_key = store.location.key(POINTER_KEY)
        pointer = json.loads(client.get_object(Bucket=bucket, Key=pointer_key)["Body"].read())
        entry = pointer["versions"]["2"]
        source = pointer["versions"]["1" if kind == "foreign_manifest" else "2"]["manifest"]
        manifest = json.loads(client.get_object(Bucket=bucket, Key=store.location.key(source))["Body"].read())
        if kind == "outside_prefix":
            name = next(iter(manifest["objects"]))
            manifest["objects"]["../../elsewhere.safetensors"] = manifest["objects"].pop(name)
            manifest["weight_map"] = {k: "../../elsewhere.safetensors" for k in manifest["weight_map"]}
        body = json.dumps(manifest).encode()
        entry["manifest"] = f"weight_v000002/{'f' * 12}/model.safetensors.index.json"
        entry["bytes"], entry["checksum"] = len(body), checksum("xxh3-128", body)
        client.put_object(Bucket=bucket, Key=store.location.key(entry["manifest"]), Body=body)
        client.put_object(Bucket=bucket, Key=pointer_key, Body=json.dumps(pointer).encode())


EXPECTED_REFUSAL = {"deleted": "is missing", "truncated": "the manifest says", "corrupted": "checksum mismatch",
                    "foreign_manifest": "the manifest says version 1, LATEST lists it as 2", "outside_prefix": "outside the version directory"}


@pytest.mark.parametrize("kind", ["deleted", "truncated", "corrupted", "foreign_manifest", "outside_prefix"])
def test_a_hostile_object_is_refused_and_the_held_version_stays(kind, published_v1, s3_bucket, tiny_qwen3_dir):
    server, bucket = s3_bucket
    url, host, store, payloads = published_v1
    _corrupt(kind, server, bucket, store, payloads[0])
    before = fingerprint(host)
    refused = cli("apply", "--store", url, "--base-dir", str(tiny_qwen3_dir), "--local-dir", str(host))
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) <= 3, refused.stderr
    assert EXPECTED_REFUSAL[kind] in refused.stderr, refused.stderr
    assert fingerprint(host) == before


def test_throttling_and_resets_are_retried_and_the_version_arrives_intact(s3_bucket, s3_server, s3_env, tiny_qwen3_dir,
                                                                         targets, tmp_path):
    _, bucket = s3_bucket
    url = f"s3://{bucket}/faults"
    publish_chain(url, tiny_qwen3_dir, targets[:1], "faults")
    from miles_disagg.bench.wan_proxy import Fault, S3Proxy

    with S3Proxy(s3_server.url).start() as proxy:
        proxy.add_fault(Fault(kind="slowdown", method="GET", times=3))
        proxy.add_fault(Fault(kind="error500", method="GET", times=1))
        proxy.add_fault(Fault(kind="reset_mid_body", method="GET", path_contains=".safetensors", times=2))
        through = f"{url}?endpoint={proxy.url}"
        prepared = Materializer(tmp_path / "host", base_dir=tiny_qwen3_dir).prepare(through, 1)
        fired = proxy.faults_fired()
        publish_chain(through, tiny_qwen3_dir, targets[:2], "faults")  # uploads (Expect: 100-continue) through it too
    assert prepared.ref.version == 1
    assert (tmp_path / "host" / "model.safetensors").read_bytes() == (targets[0] / "model.safetensors").read_bytes()
    assert fired.get("slowdown") == 3 and fired.get("reset_mid_body") == 2, fired


def test_a_relay_serves_its_region_once_and_a_dead_relay_costs_only_a_fallback(s3_bucket, s3_server, s3_env,
                                                                               tiny_qwen3_dir, targets, tmp_path):
    from miles_disagg.net.process import free_port

    _, bucket = s3_bucket
    url = f"s3://{bucket}/relayed"
    publish_chain(url, tiny_qwen3_dir, targets[:1], "relayed")
    port = free_port("127.0.0.1")
    relay = subprocess.Popen([sys.executable, "-m", "miles_disagg.cli", "relay", "--store", url, "--cache-dir",
                              str(tmp_path / "relay"), "--port", str(port), "--region", "eu"],
                             env={**os.environ, **s3_server.env()}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        assert "listening" in relay.stdout.readline()
        through = f"{url}?relay=http://127.0.0.1:{port}"
        transfers = [Materializer(tmp_path / f"host-{i}", base_dir=tiny_qwen3_dir).prepare(through, 1).transfer
                     for i in range(3)]
    finally:
        relay.kill()
        relay.wait(scaled(30))
    size = sum(t["relay_bytes"] for t in transfers) // 3
    assert [t["wan_bytes"] for t in transfers] == [size, 0, 0]  # one WAN copy for the region
    assert all(t["store_bytes"] == 0 and t["relay_fallbacks"] == 0 for t in transfers)
    fallback = Materializer(tmp_path / "host-late", base_dir=tiny_qwen3_dir).prepare(through, 1).transfer
    assert fallback["relay_fallbacks"] >= 1 and fallback["store_bytes"] == size and fallback["wan_bytes"] == size
    for i in range(3):
        assert (tmp_path / f"host-{i}" / "model.safetensors").read_bytes() == \
            (targets[0] / "model.safetensors").read_bytes()


SECRET = "not-to-be-printed-0f1e2d3c"


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_wrong_credentials_and_an_unreachable_endpoint_end_the_run_before_ray(dry_run, tmp_path):
    from s3_server import S3Server

    refusing = S3Server(check_credentials=True).start()
    try:
        for endpoint, cause in ((refusing.url, "refused the credentials"), ("http://127.0.0.1:9", "did not answer")):
            env = {**os.environ, "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEWRONG", "AWS_SECRET_ACCESS_KEY": SECRET,
                   "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}
            proc = subprocess.run([sys.executable, "train_async.py", "--config", "configs/tiny_cpu.yaml", "--run-dir",
                                   str(tmp_path / "run"), "--update-weight-disk-dir", "s3://bucket-of-the-run/prefix",
                                   *(["--dry-run"] if dry_run else [])],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(120))
            assert proc.returncode == 2, (proc.stdout, proc.stderr)
            error_lines = [line for line in proc.stderr.splitlines() if "error" in line]
            assert len(error_lines) == 1 and cause in error_lines[0] and "s3://bucket-of-the-run/prefix" in error_lines[0]
            assert SECRET not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr
            assert "starting a local Ray" not in proc.stderr
    finally:
        refusing.stop()


def test_serve_local_converges_on_an_object_store_with_the_base_from_it(s3_bucket, s3_env, tiny_qwen3_dir, targets,
                                                                         tmp_path):
    """No path shared with the publisher: each replica fetches the store's base onto its own node."""
    from miles_disagg.service.launch import ReplicaOptions
    from miles_disagg.service.local import launch_local_service

    _, bucket = s3_bucket
    url = f"s3://{bucket}/service"
    published = cli("publish", "--store", url, "--base-dir", str(tiny_qwen3_dir), "--target-dir", str(targets[0]),
                    "--run-id", "service", "--base-in-store")
    assert published.returncode == 0, published.stderr
    fetched = cli("fetch-base", "--store", url, "--dest", str(tmp_path / "by-hand"))  # a node starting SGLang by hand
    assert fetched.returncode == 0 and fingerprint_base(tmp_path / "by-hand") == fingerprint_base(tiny_qwen3_dir)
    refused = cli("fetch-base", "--store", str(tmp_path), "--dest", str(tmp_path / "nowhere"))
    assert refused.returncode == 2 and "only an object store holds a base" in refused.stderr, refused.stderr
    for wrong in (["--base-dir", str(tiny_qwen3_dir)], ["--store", str(tmp_path)]):
        refused = serve_local_dry(url, wrong)
        assert refused.returncode == 2 and "--base-from-store" in refused.stderr, refused.stderr
    work = tmp_path / "work"
    service = launch_local_service(url, None, work_dir=work, num_replicas=2, wait_ready_s=scaled(120),
                                   replica=ReplicaOptions(poll_interval_s=0.3, heartbeat_interval_s=0.3,
                                                          base_from_store=True))
    client = service.client()
    try:
        assert {r["weight_version"] for r in client.wait_converged(1, num_replicas=2, timeout_s=scaled(60))} == {1}
        bases = sorted(work.glob("*/local-checkpoint.base"))
        assert len(bases) == 2 and all(fingerprint_base(b) == fingerprint_base(tiny_qwen3_dir) for b in bases)
        publisher = DeltaPublisher(url, base_dir=tiny_qwen3_dir, run_id="service")
        publisher.capture_baseline()
        publisher.publish(load_file(str(targets[1] / "model.safetensors")).items())
        publisher.close()
        assert {r["weight_version"] for r in client.wait_converged(2, num_replicas=2, timeout_s=scaled(90))} == {2}
    finally:
        client.close()
        service.stop()


def serve_local_dry(url: str, extra: list[str]) -> subprocess.CompletedProcess:
    """``serve local --base-from-store`` with a wrong companion flag: refused before anything starts."""
    args = ["--store", url, "--base-from-store", *extra]
    if "--store" in extra:
        args = args[2:]
    return subprocess.run([sys.executable, "-m", "miles_disagg.cli", "serve", "local", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=scaled(120))


def fingerprint_base(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".safetensors", ".json")
            and p.name != "model.safetensors.index.json" and not p.name.startswith(".")}
