"""``miles-disagg serve local`` and ``miles-disagg weights publish`` as subprocesses: a version
published into the store reaches the replica with no further command (no wake, no handle)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from deadlines import scaled

from service_fixtures import body, serve_until_ok
from miles_disagg.net.process import free_port
from miles_disagg.service.client import GatewayClient

pytestmark = pytest.mark.timeout(180)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def miles_disagg(*args: str) -> list[str]:
    return [sys.executable, "-m", "miles_disagg.cli", *args]


def first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first stdout line of ``proc`` (empty if it exits or says nothing in time)."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return lines[0] if lines else ""


def make_target(base: Path, out: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    tensors = load_file(str(base / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    tensors = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_serve_local_follows_versions_published_with_the_weights_cli(tiny_qwen3_dir: Path, tmp_path: Path):
    store, work = tmp_path / "store", tmp_path / "work"
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen(miles_disagg("serve", "local", "--replicas", "1", "--store", str(store), "--base-dir",
                                          str(tiny_qwen3_dir), "--port", str(port), "--work-dir", str(work),
                                          "--poll-interval", "0.3", "--heartbeat-interval", "0.3"),
                             stdout=subprocess.PIPE, stderr=log, text=True, env=ENV)
    try:
        line = first_line(serve, 150)
        assert f"gateway http://127.0.0.1:{port}" in line, (line, (tmp_path / "serve.log").read_text())
        url = f"http://127.0.0.1:{port}"
        with GatewayClient(url) as client:
            [replica] = client.replicas()
            assert (replica["state"], replica["weight_version"]) == ("ready", 0)
            published = subprocess.run(
                miles_disagg("weights", "publish", "--base-dir", str(tiny_qwen3_dir), "--store", str(store),
                             "--target-dir", str(make_target(tiny_qwen3_dir, tmp_path / "target"))),
                capture_output=True, text=True, env=ENV, timeout=scaled(120))
            assert published.returncode == 0, published.stderr
            version = json.loads(published.stdout)["version"]
            assert version == 1
            answer, _ = serve_until_ok(url, body(weight_version={"min_version": version}), timeout_s=60)
            assert answer["meta_info"]["weight_version_start"] == version
            engine_url = client.replicas()[0]["engine_url"]
    finally:
        serve.send_signal(signal.SIGINT)
        code = serve.wait(timeout=scaled(60))
        log.close()
    assert code == 0, (tmp_path / "serve.log").read_text()
    for gone in (url, engine_url):  # the gateway and the replica's engine stopped with it
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{gone}/health", timeout=5, trust_env=False)


def test_an_attached_replica_catches_up_keeps_serving_through_a_bad_version_and_is_vouched_for_only_alive(
        tiny_qwen3_dir: Path, tmp_path: Path):
    from engine_fixtures import wait_until
    from service_fixtures import Publisher, corrupt_payload
    from miles_disagg.engines.launch import launch_engine
    from miles_disagg.service.launch import launch_gateway

    def corrupt_v2(version_dir, ref):
        if ref.version == 2:
            corrupt_payload(version_dir)

    publisher = Publisher(tmp_path / "store", tiny_qwen3_dir, post_write_hook=corrupt_v2)
    version = publisher.publish()  # published before the replica exists: it must catch up
    engine = launch_engine(tiny_qwen3_dir, log_path=tmp_path / "engine.log",  # its roots: the store, the replica's dir
                           extra_args=["--weight-store-dir", str(tmp_path / "store"),
                                       "--local-checkpoint-dir", str(tmp_path / "local")])
    gateway = launch_gateway(log_path=tmp_path / "gateway.log", heartbeat_timeout_s=1.0, retry_after_s=0.2)
    with open(tmp_path / "replica.log", "wb") as log:
        replica = subprocess.Popen(
            miles_disagg("serve", "replica", "--store", str(tmp_path / "store"), "--gateway", gateway.url,
                         "--engine", f"url:{engine.url}", "--base-dir", str(tiny_qwen3_dir), "--local-checkpoint-dir",
                         str(tmp_path / "local"), "--replica-id", "attached", "--poll-interval", "0.3",
                         "--heartbeat-interval", "0.3"),
            stdout=subprocess.DEVNULL, stderr=log, env=ENV)
    try:
        with GatewayClient(gateway.url) as client:
            [entry] = client.wait_converged(version, num_replicas=1, timeout_s=60)
            assert entry["engine_url"] == engine.url and entry["counters"]["num_activations"] == 1
            answer, _ = serve_until_ok(gateway.url, body(weight_version={"exact_version": version}), timeout_s=30)
            assert answer["meta_info"]["routed_worker"] == engine.url
            assert publisher.publish() == 2  # its payload fails verification on the host
            [entry] = client.wait_for(lambda rs: "staging failed" in (rs[0]["last_error"] or ""), 30,
                                      "the staging failure reported")
            assert (entry["state"], entry["weight_version"]) == ("ready", version)  # still serving v1
            assert "/pull_weights answered 400" in entry["last_error"], entry  # the host refused to verify it
            answer, _ = serve_until_ok(gateway.url, body(weight_version={"min_version": version}), timeout_s=30)
            assert answer["meta_info"]["weight_version_start"] == version
            refused = httpx.post(f"{gateway.url}/generate", json=body(weight_version={"exact_version": 2}),
                                 timeout=30, trust_env=False)
            assert refused.status_code == 409  # never an older policy under a newer constraint
            replica.kill()  # the engine keeps running, but nobody vouches for its version anymore
            wait_until(lambda: client.replicas()[0]["lost"], timeout=30, what="the replica marked lost")
            refused = httpx.post(f"{gateway.url}/generate", json=body(), timeout=30, trust_env=False)
            assert refused.status_code == 503 and refused.json()["retryable"] is True
            assert httpx.get(f"{engine.url}/health", timeout=5, trust_env=False).status_code == 200
    finally:
        replica.kill()
        replica.wait(30)
        gateway.stop()
        engine.stop()
        publisher.close()
