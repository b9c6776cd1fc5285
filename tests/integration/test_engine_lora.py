"""The built-in engine serves LoRA adapters (``--enable-lora``) through SGLang's API: adapters the
trainer made, loaded by ``/load_lora_adapter`` while it generates, chosen per request by
``lora_path``, mixed in one batch; their logprobs are PEFT's own model's on the same weights; at
most ``--max-loaded-loras`` resident; unloading waits for in-flight requests without blocking
anything; malformed adapters and paths outside ``--lora-root`` are refused with nothing loaded."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_fixtures import Background, inprocess_engine, long_request, wait_in_flight, wait_until
from lora_fixtures import lora_samples, lora_trainer
from router_fixtures import generate_body, inprocess_router

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def adapters(tiny_qwen3_dir, tmp_path_factory):
    """Two versions of one trained adapter (``v1``, ``v2``) under one root, and a third."""
    from miles_disagg.trainer.lora import adapter_config
    from miles_disagg.weights.adapters import write_adapter_dir

    root = tmp_path_factory.mktemp("lora-root")
    trainer = lora_trainer(tiny_qwen3_dir, lr=5e-2)
    for version in (1, 2, 3):
        for step in range(3):
            trainer.train([lora_samples(step + version)])
        write_adapter_dir(root / f"v{version}", adapter_config(trainer.lora), trainer.adapter_tensors())
    return root


def peft_logprobs(model_dir, adapter_dir, tokens: list[int]) -> torch.Tensor:
    """PEFT's model on transformers' Qwen3: the logprob of each token after the prompt."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                      str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return torch.stack([logprobs[i - 1, tokens[i]] for i in range(len(PROMPT), len(tokens))])


def generate(handle, lora_path, rid: str, max_new_tokens: int = 6, seed: int = 3):
    body = {"input_ids": [PROMPT] * len(lora_path) if isinstance(lora_path, list) else PROMPT, "rid": rid,
            "lora_path": lora_path, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True,
                                "sampling_seed": seed}}
    if isinstance(lora_path, list):
        body["rid"] = [f"{rid}-{i}" for i in range(len(lora_path))]
    return handle.generate(body)


def tokens_and_logprobs(result) -> tuple[list[int], torch.Tensor]:
    triples = result["meta_info"]["output_token_logprobs"]
    return [t[1] for t in triples], torch.tensor([t[0] for t in triples])


@pytest.fixture(scope="module")
def served(tiny_qwen3_dir, adapters):
    # the prefix cache on: a row's KV is reused only under its own adapter (the base's first run of
    # PROMPT must not serve the later rows that run it with v1 or v2)
    with inprocess_engine(tiny_qwen3_dir, enable_lora=True, lora_roots=[str(adapters)],
                          max_loaded_loras=2) as (engine, handle):
        yield engine, handle


def test_adapters_serve_peft_logprobs_and_mix_in_one_batch(served, adapters, tiny_qwen3_dir) -> None:
    _, handle = served
    for name in ("v1", "v2"):
        answer = handle.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters / name)})
        assert answer.status_code == 200 and answer.json()["success"], answer.text
    info = handle.get("/server_info").json()
    assert info["enable_lora"] and info["max_loaded_loras"] == 2
    assert {a["lora_name"] for a in info["loaded_lora_adapters"]} == {"v1", "v2"}

    base_tokens, base_logprobs = tokens_and_logprobs(generate(handle, None, "alone-base"))
    alone = {}
    for name in ("v1", "v2"):
        tokens, logprobs = tokens_and_logprobs(generate(handle, name, f"alone-{name}"))
        torch.testing.assert_close(logprobs, peft_logprobs(tiny_qwen3_dir, adapters / name, PROMPT + tokens),
                                   rtol=1e-4, atol=1e-4)
        alone[name] = (tokens, logprobs)
    cache = lambda: handle.get("/server_info").json()["internal_states"][0]["prefix_cache"]["hit_tokens"]  # noqa: E731
    assert cache() == 0  # the base's PROMPT served neither adapter
    assert not torch.allclose(base_logprobs, alone["v1"][1], atol=1e-3)  # the adapter changes the policy
    mixed = generate(handle, ["v1", "v2", None, "v1"], "mixed")
    for result, name in zip(mixed, ["v1", "v2", None, "v1"]):
        tokens, logprobs = tokens_and_logprobs(result)
        expected_tokens, expected = alone[name] if name else (base_tokens, base_logprobs)
        assert tokens == expected_tokens
        torch.testing.assert_close(logprobs, expected, rtol=1e-4, atol=1e-5)
    assert cache() > 0  # rows reused the KV of their own adapter's earlier run


def test_bounded_unload_waits_for_in_flight_and_blocks_nothing(served, adapters) -> None:
    _, handle = served
    full = handle.post("/load_lora_adapter", {"lora_name": "v3", "lora_path": str(adapters / "v3")})
    assert full.status_code == 409 and "--max-loaded-loras" in full.text
    running = long_request(handle, "long-v1", 400, lora_path="v1")
    wait_in_flight(handle, [running])
    answer = handle.post("/unload_lora_adapter", {"lora_name": "v1"}).json()
    assert answer["unloaded"] is False and answer["in_flight"] == 1  # answered at once, the request goes on
    refused = handle.post("/generate", {"input_ids": PROMPT, "lora_path": "v1", "sampling_params": {"max_new_tokens": 1}})
    assert refused.status_code == 400 and "no loaded LoRA adapter" in refused.text
    loaded = handle.post("/load_lora_adapter", {"lora_name": "v3", "lora_path": str(adapters / "v3")})
    assert loaded.status_code == 409  # v1 still holds its slot while its request runs
    assert len(running.result()["output_ids"]) == 400  # finished on v1
    wait_until(lambda: "v1" not in {a["lora_name"] for a in handle.get("/server_info").json()["loaded_lora_adapters"]},
               what="v1 unloaded after its last request")
    loaded = handle.post("/load_lora_adapter", {"lora_name": "v3", "lora_path": str(adapters / "v3")})
    assert loaded.status_code == 200, loaded.text
    assert handle.post("/unload_lora_adapter", {"lora_name": "v3"}).json()["unloaded"] is True


def test_malformed_adapters_and_paths_are_refused_with_nothing_loaded(served, adapters, tmp_path) -> None:
    _, handle = served
    before = handle.get("/server_info").json()["loaded_lora_adapters"]
    bad = adapters / "bad-rank"
    shutil.copytree(adapters / "v1", bad, dirs_exist_ok=True)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 2}))
    truncated = adapters / "truncated"
    shutil.copytree(adapters / "v1", truncated, dirs_exist_ok=True)
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    outside = tmp_path / "elsewhere"
    shutil.copytree(adapters / "v1", outside)
    for body, status, fragment in (
        ({"lora_name": "bad", "lora_path": str(bad)}, 400, "r = 2"),
        ({"lora_name": "bad", "lora_path": str(truncated)}, 400, "truncated"),
        ({"lora_name": "bad", "lora_path": str(outside)}, 403, "--lora-root"),
        ({"lora_name": "bad", "lora_path": str(adapters / "v1" / ".." / ".." / outside.name)}, 403, "--lora-root"),
        ({"lora_name": "", "lora_path": str(adapters / "v1")}, 400, "lora_name"),
        ({"lora_name": "x" * 300, "lora_path": str(adapters / "v1")}, 400, "lora_name"),
        ({"lora_path": str(adapters / "v1")}, 400, "lora_name"),
    ):
        answer = handle.post("/load_lora_adapter", body)
        assert answer.status_code == status and fragment in answer.text, (body, answer.text)
    assert handle.get("/server_info").json()["loaded_lora_adapters"] == before
    unknown = handle.post("/generate", {"input_ids": PROMPT, "lora_path": "nope", "sampling_params": {"max_new_tokens": 1}})
    assert unknown.status_code == 400 and "nope" in unknown.text


def test_a_runs_adapter_versions_activate_without_a_pause_and_older_ones_serve_pinned_requests(
        tiny_qwen3_dir, adapters, tmp_path) -> None:
    """``--lora-base-dir``: /pull_weights materializes adapter versions from the store, /activate_weights
    serves one without pausing; a request in flight finishes on its version, start to end. The newest
    ``--lora-resident-versions`` (2) stay resident: through the router an exact-version request for the
    older one runs on its adapter (what that version alone served); the oldest beyond two leaves once its
    last request ends, and an exact request for it is then the router's 409."""
    from safetensors.torch import load_file

    from miles_disagg.weights.publisher import DeltaPublisher

    store, local = tmp_path / "store", tmp_path / "host" / "ckpt"
    local.parent.mkdir()
    publisher = DeltaPublisher(store, base_dir=adapters / "v1", run_id="lora", encoding="xor", filter="none")
    publisher.capture_baseline()
    for source in ("v2", "v3", "v1"):  # versions 1, 2 and 3 of the chain
        publisher.publish(load_file(str(adapters / source / "adapter_model.safetensors")).items())
        if source == "v3":
            published = publisher.published_checksums("xxh3-128")  # what an engine serving version 2 must hold
    publisher.close()
    with inprocess_engine(tiny_qwen3_dir, enable_lora=True, lora_base_dir=adapters / "v1", lora_resident_versions=2,
                          weight_store_dirs=[str(store)], local_checkpoint_dir=local) as (engine, handle), \
            inprocess_router(workers=(handle.url,)) as router:
        def update(version: int) -> dict:
            pulled = handle.post("/pull_weights", {"target_version": version, "source_dir": str(store)})
            assert pulled.status_code == 200 and pulled.json()["lora"], pulled.text
            answer = handle.post("/activate_weights", {"weight_version": str(version)})
            assert answer.status_code == 200, answer.text
            return answer.json()

        def loaded() -> dict[str, int]:
            return {a["lora_name"]: a["in_flight"] for a in handle.get("/server_info").json()["loaded_lora_adapters"]}

        def older_seen() -> dict:
            return router.client.worker(handle.url).get("older_versions", {})

        def pinned(version: int, **extra):
            return router.generate({**generate_body(return_logprob=True), "weight_version": {"exact_version": version},
                                    **extra})

        assert update(1)["pause_ms"] == 0.0
        alone_v1 = tokens_and_logprobs(handle.generate(generate_body(return_logprob=True)))  # version 1 alone
        running = long_request(handle, "on-v1", 300)
        wait_in_flight(handle, [running])
        second = update(2)  # while v1 still decodes
        assert (second["pause_ms"], second["resident_weight_versions"], handle.version()) == (0.0, {"1": "v1", "2": "v2"}, "2")
        fresh = handle.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        meta = running.result()["meta_info"]
        assert (meta["weight_version_start"], meta["weight_version_end"]) == ("1", "1")
        assert (fresh["meta_info"]["weight_version_start"], fresh["meta_info"]["weight_version_end"]) == ("2", "2")
        info = handle.get("/model_info").json()
        assert (info["weight_version"], info["resident_weight_versions"]) == ("2", {"1": "v1", "2": "v2"})
        assert loaded() == {"v1": 0, "v2": 0}  # v1 idle but resident: K is not exceeded
        sums = handle.get("/weight_checksums", params={"algorithm": "xxh3-128"}).json()  # --check-weight-update-equal
        assert (sums["weight_version"], sums["source"], sums["checksums"]) == ("2", "lora", published)

        wait_until(lambda: older_seen() == {"1": "v1"}, what="the router reads the older resident version")
        answer = pinned(1)
        assert answer.status_code == 200, answer.text
        assert tokens_and_logprobs(answer.json())[0] == alone_v1[0]
        torch.testing.assert_close(tokens_and_logprobs(answer.json())[1], alone_v1[1], rtol=0, atol=0)
        meta = answer.json()["meta_info"]
        assert (meta["weight_version_start"], meta["weight_version_end"]) == (1, 1)  # the adapter it ran on
        newest = router.generate(generate_body(), headers={"X-Weight-Version-Exact": "2"}).json()["meta_info"]
        assert (newest["weight_version_start"], newest["weight_version_end"]) == (2, 2)
        refused = router.generate({**generate_body(), "weight_version": {"min_version": 3}})
        assert refused.status_code == 409 and refused.json()["available_versions"] == [1, 2]

        on_v1 = Background(lambda: pinned(1, input_ids=[5, 6, 7, 8], sampling_params={
            "max_new_tokens": 300, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1}))
        wait_until(lambda: loaded().get("v1") == 1, what="a pinned request decoding on v1")
        third = update(3)  # K exceeded: v1 is evicted, and leaves once its request ends
        assert (third["pause_ms"], third["evicted_versions"], third["resident_weight_versions"]) == \
            (0.0, ["1"], {"2": "v2", "3": "v3"})
        assert loaded() == {"v1": 1, "v2": 0, "v3": 0}  # still running its request
        meta = on_v1.result().json()["meta_info"]
        assert (meta["weight_version_start"], meta["weight_version_end"]) == (1, 1)
        wait_until(lambda: set(loaded()) == {"v2", "v3"}, what="v1 unloaded once its request ended")
        wait_until(lambda: older_seen() == {"2": "v2"}, what="the router reads v1's eviction")
        gone = pinned(1)
        assert gone.status_code == 409 and gone.json()["available_versions"] == [2, 3], gone.text
        assert engine.scheduler.paused_mode is None and \
            handle.get("/server_info").json()["internal_states"][0]["num_aborted_requests"] == 0

        assert handle.post("/unload_lora_adapter", {"lora_name": "v2"}).status_code == 200  # by hand: no longer listed
        assert handle.get("/model_info").json()["resident_weight_versions"] == {"3": "v3"}
        refused = handle.post("/unload_lora_adapter", {"lora_name": "v3"})
        assert refused.status_code == 400 and "served" in refused.text  # never left serving the bare base
