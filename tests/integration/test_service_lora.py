"""The rollout service serving a run's LoRA adapter versions: ``serve local --lora-base-dir`` (the
in-process launch the CLI runs) over a store the publisher's real path writes adapter versions to.
Its replicas' built-in engines load each version beside the resident base with no pause and stay
in routing meanwhile; the gateway announces the adapter chain and takes no replica of another; a run
vets the service before step 1 and refuses, in one line, one that would serve the bare base."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from engine_fixtures import inprocess_engine
from lora_fixtures import lora_samples, lora_trainer
from service_fixtures import body, serve_until_ok

from miles_disagg.types import ConfigError, InvalidInput

pytestmark = pytest.mark.timeout(300)

CONVERGE_S = 120.0


@pytest.fixture(scope="module")
def world(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from miles_disagg.service.launch import ReplicaOptions
    from miles_disagg.service.local import launch_local_service
    from miles_disagg.trainer.lora import adapter_config
    from miles_disagg.weights.adapters import write_adapter_dir
    from miles_disagg.weights.publisher import DeltaPublisher

    root = tmp_path_factory.mktemp("service-lora")
    store, chain = root / "store", root / "store.lora-v0"  # where a run on this store keeps its chain's version 0
    store.mkdir()
    trainer = lora_trainer(tiny_qwen3_dir, lr=5e-2)
    options = ReplicaOptions(poll_interval_s=0.3, heartbeat_interval_s=0.3, lora_base_dir=chain)
    service = launch_local_service(store, tiny_qwen3_dir, work_dir=root / "work", num_replicas=2, replica=options,
                                   retry_after_s=0.2, wait_ready_s=CONVERGE_S)  # the chain is not there: no wait
    client = service.client()
    try:
        client.wait_for(lambda rs: len(rs) == 2 and all(r["state"] == "catching_up" and r["last_error"] for r in rs),
                        CONVERGE_S, "both replicas waiting for the adapter chain's version 0")
        assert client.workers() == [] or all(w["state"] != "ready" for w in client.workers())  # nothing served
        write_adapter_dir(chain, adapter_config(trainer.lora), trainer.adapter_tensors())  # as the run's trainer does
        publisher = DeltaPublisher(store, base_dir=chain, run_id="lora-service", encoding="xor", filter="none")
        publisher.capture_baseline()
        assert len(client.wake()["woken"]) == 2  # as the run does once connected: no backoff left to wait out
        client.wait_converged(0, num_replicas=2, timeout_s=CONVERGE_S)
    except BaseException:
        client.close()
        service.stop()
        raise
    try:
        yield {"service": service, "client": client, "publisher": publisher, "trainer": trainer, "store": store,
               "chain": chain, "model": tiny_qwen3_dir, "root": root}
    finally:
        client.close()
        service.stop()
        publisher.close()


def run_chain(model: Path, store: Path, url: str) -> str | None:
    """The adapter chain a LoRA run on ``store`` through the service at ``url`` serves (None: full weights)."""
    from miles_disagg.config.actors import EngineManagerConfig
    from miles_disagg.config.loader import load_config

    config = load_config(["--hf-checkpoint", str(model), "--train-backend", "fsdp", "--lora-rank", "4",
                          "--lora-alpha", "8", "--update-weight-transfer-mode", "disk-delta",
                          "--update-weight-disk-dir", str(store), "--rollout-service-url", url], "train_async")[0]
    return EngineManagerConfig.from_run(config).lora_base_dir


def test_replicas_converge_on_each_adapter_version_with_no_pause_and_serve_it(world, tmp_path) -> None:
    from miles_disagg.engines.updater import DiskDeltaUpdater

    client, publisher, trainer = world["client"], world["publisher"], world["trainer"]
    for version in (1, 2):
        trainer.train([lora_samples(version)])
        assert publisher.publish(trainer.adapter_tensors().items()).ref.version == version
        client.wait_converged(version, num_replicas=2, timeout_s=CONVERGE_S)
    replicas = client.replicas()
    assert len(replicas) == 2
    for replica in replicas:
        assert [a["version"] for a in replica["activations"]] == [0, 1, 2]  # the chain's v0 first: never the base
        assert [a["pause_s"] for a in replica["activations"]] == [0.0, 0.0, 0.0]
        assert "activating" not in [t[1] for t in replica["transitions"]]  # in routing through each activation
        assert replica["lora_base_dir"] == str(world["chain"])
    greedy = body(max_new_tokens=6, greedy=True, return_logprob=True)
    served, _ = serve_until_ok(world["service"].url, {**greedy, "weight_version": {"min_version": 2}})
    meta = served["meta_info"]
    assert (meta["weight_version_start"], meta["weight_version_end"]) == (2, 2)
    older, _ = serve_until_ok(world["service"].url, {**greedy, "weight_version": {"exact_version": 1}})
    assert older["meta_info"]["weight_version_start"] == 1  # the older adapter is still resident
    local = tmp_path / "host" / "ckpt"
    local.parent.mkdir()
    with inprocess_engine(world["model"], enable_lora=True, lora_base_dir=world["chain"],
                          weight_store_dirs=[str(world["store"])], local_checkpoint_dir=local) as (_engine, handle):
        updater = DiskDeltaUpdater([handle.url], store_dir=str(world["store"]), local_dirs=[str(local)])
        try:
            updater.update(2)
        finally:
            updater.close()
        own = handle.generate(greedy)
    assert served["output_ids"] == own["output_ids"]
    ours = [entry[0] for entry in served["meta_info"]["output_token_logprobs"]]
    theirs = [entry[0] for entry in own["meta_info"]["output_token_logprobs"]]
    assert ours == pytest.approx(theirs, abs=1e-5)
    assert ours != pytest.approx([entry[0] for entry in older["meta_info"]["output_token_logprobs"]], abs=1e-6)


def test_a_run_vets_the_services_adapter_chain_before_step_1(world) -> None:
    from miles_disagg.service.client import check_service_serves
    from miles_disagg.service.launch import launch_gateway

    url, store = world["service"].url, world["store"]
    assert world["client"].service_info() == {"serves": "lora_adapter_versions", "lora_base_dir": str(world["chain"])}
    chain = run_chain(world["model"], store, url)
    assert chain == str(world["chain"])
    check_service_serves(url, chain)  # this run's chain: taken
    with pytest.raises(ConfigError) as other:
        check_service_serves(url, str(world["root"] / "other.lora-v0"))
    assert "would not serve this run's adapters" in str(other.value) and "\n" not in str(other.value)
    with pytest.raises(ConfigError) as full:
        check_service_serves(url, None)  # a full-weight run
    assert "publishes full-weight versions" in str(full.value)
    bare = launch_gateway(log_path=world["root"] / "bare-gateway.log")
    try:
        with pytest.raises(ConfigError) as refused:
            check_service_serves(bare.url, run_chain(world["model"], store, bare.url))
    finally:
        bare.stop()
    line = str(refused.value)
    assert "\n" not in line and "serves full-weight versions" in line and "bare base" in line
    assert f"--lora-base-dir {chain}" in line and refused.value.flags == ("--rollout-service-url",)


def test_the_gateway_takes_no_replica_of_another_chain_or_of_full_weights(world) -> None:
    from miles_disagg.service.adapters import GatewayLink
    from miles_disagg.service.protocol import ReplicaState, ReplicaStatus

    link = GatewayLink(world["service"].url)
    try:
        for chain, fragment in ((None, "serves full-weight versions"), ("/elsewhere", "'/elsewhere'")):
            status = ReplicaStatus(replica_id="intruder", incarnation="x", seq=1, engine_url="http://127.0.0.1:9",
                                   control_url=None, state=ReplicaState.READY, weight_version=2, lora_base_dir=chain)
            with pytest.raises(InvalidInput, match=fragment):
                link.report(status)
    finally:
        link.close()
    assert "intruder" not in [r["replica_id"] for r in world["client"].replicas()]
    with httpx.Client(timeout=10, trust_env=False) as http:
        assert http.get(f"{world['service'].url}/service_info").json()["serves"] == "lora_adapter_versions"
