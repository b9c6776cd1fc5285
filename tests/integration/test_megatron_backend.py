"""The megatron backend on real Ray (logical GPUs, gloo, float32 on CPU).

- Parity: a tiny Qwen3 loaded into megatron's GPTModel gives transformers' logits, and its
  export gives back the checkpoint's bytes (float32 and bfloat16 checkpoints).
- Tensor parallelism: TP=2 exports the same bytes as TP=1 for the same weights, and one
  GRPO step gives the same loss and (to float tolerance) the same weights.
- Data parallelism: two DP ranks on a ragged batch with masked tool tokens compute exactly what
  one fsdp rank computes, for the per-sample and the per-token loss (the loss is normalised over
  the global batch).
- Recomputation, token-budget micro-batches, the KL reference (logged at coefficient 0),
  resuming from a checkpoint.
- Distributed checkpointing: a TP=1 save loads into TP=2 and a TP=2 save into TP=1, exactly.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'miles-disagg[megatron]')")

from checkpoint_reading import assert_same_state, read_state  # noqa: E402

from miles_disagg.config.components import TrainConfig, WeightUpdateConfig  # noqa: E402
from miles_disagg.samples import Sample  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pool():
    """Trainer rank processes on a private Ray, hosting every group and fresh-process check of the
    module in turn (megatron's parallel state and CPU patches are process-wide: each is dropped
    before the next group)."""
    from rank_pool import private_ray_pool

    with private_ray_pool() as ranks:
        yield ranks


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(next(model_dir.glob("*.safetensors"))))


def parity_on_one_rank(model_dirs: list[str], num_tokens: int) -> list[dict]:
    """In a rank process hosting no group, for each checkpoint: load it into a TP=1 GPTModel; logits vs
    transformers' (float32 compute), export vs the file."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from miles_disagg.engines.launch import free_port
    from miles_disagg.distributed import init_distributed
    from miles_disagg.trainer.megatron.backend import MegatronBackend
    from miles_disagg.trainer.megatron.batching import causal_mask

    init_distributed(0, 1, "127.0.0.1", free_port())
    input_ids = torch.randint(3, 90, (3, num_tokens), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(num_tokens).unsqueeze(0).expand(3, -1)
    results = []
    for model_dir in model_dirs:
        backend = MegatronBackend(TrainConfig(train_backend="megatron"), model_dir, rank=0, world_size=1)
        exported = {name: t.clone() for name, t in backend.named_tensors()}
        with torch.no_grad():
            megatron_logits = backend.gpt(input_ids, positions, causal_mask(num_tokens))
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            hf_logits = hf(input_ids=input_ids).logits
        results.append({"max_abs_diff": (megatron_logits - hf_logits).abs().max().item(), "exported": exported})
    dist.destroy_process_group()
    return results


def test_logits_match_transformers_and_export_round_trips_bytes(pool, tiny_qwen3_dir: Path,
                                                                 tmp_path: Path) -> None:
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    bf16_dir = make_tiny_qwen3(tmp_path / "bf16", dtype="bfloat16", seed=3)
    fp32, bf16 = pool.run(parity_on_one_rank, [str(tiny_qwen3_dir), str(bf16_dir)], 13)
    assert fp32["max_abs_diff"] < 1e-4
    for result, model_dir in ((fp32, tiny_qwen3_dir), (bf16, bf16_dir)):
        base = checkpoint_tensors(model_dir)
        assert set(result["exported"]) == set(base)
        for name, tensor in base.items():
            exported = result["exported"][name]
            assert exported.dtype == tensor.dtype and exported.shape == tensor.shape, name
            assert exported.view(torch.uint8).equal(tensor.view(torch.uint8)), name  # byte-identical


# ---------------------------------------------------------------------- tensor parallelism over Ray actors


def samples(n: int = 8) -> list[Sample]:
    """Varied prompt and response lengths (padding, several micro-batches); every third sample
    has a token its policy did not generate (masked out of the loss)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 60, (3 + i % 3,), generator=generator).tolist()
        response = torch.randint(3, 60, (4 + i % 2,), generator=generator).tolist()
        mask = [0 if (i % 3 == 0 and t == 1) else 1 for t in range(len(response))]
        out.append(Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[-4.0] * len(response),
                          advantage=float(i % 2) - 0.5 + 0.1 * i, loss_mask=mask))
    return out


@contextmanager
def trainer_group(pool, model_dir: Path, world_size: int, **train_flags):
    """A set-up TrainerGroup of ``world_size`` of the pool's ranks (given back on exit)."""
    from miles_disagg.config.actors import TrainerGroupConfig

    flags = {"lr": 1e-2, "global_batch_size": 8, "micro_batch_size": 2, "seed": 0, **train_flags}
    config = TrainerGroupConfig(train=TrainConfig(**flags), weights=WeightUpdateConfig(), hf_dir=str(model_dir))
    with pool.group(world_size, config) as group:
        yield group


def train_group(pool, model_dir: Path, world_size: int, **train_flags) -> tuple[dict[str, bytes], object, dict[str, bytes]]:
    """(exported bytes before training, the TrainResult of one rollout, exported bytes after)."""
    with trainer_group(pool, model_dir, world_size, **train_flags) as group:
        before = group.tensor_bytes()
        result = group.train(samples())
        return before, result, group.tensor_bytes()


def as_tensors(raw: dict[str, bytes], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.frombuffer(bytearray(raw[n]), dtype=like[n].dtype).view(like[n].shape) for n in like}


@pytest.fixture(scope="module")
def tp1_and_tp2(pool, tiny_qwen3_dir: Path, tmp_path_factory) -> dict:
    """One TP=1 and one TP=2 group (the rank processes of both tests below): each trains a rollout
    from the same weights; then TP=1 saves, TP=2 loads that save and saves, TP=1 (moved on by a
    step) loads the TP=2 save and saves, and both train one more step."""
    root = tmp_path_factory.mktemp("tp-saves")
    out: dict = {"saves": {name: root / name for name in ("tp1", "tp2", "back")}}
    batch = samples()
    with trainer_group(pool, tiny_qwen3_dir, 1, train_backend="megatron") as tp1, \
            trainer_group(pool, tiny_qwen3_dir, 2, train_backend="megatron", tensor_model_parallel_size=2) as tp2:
        for name, group in (("tp1", tp1), ("tp2", tp2)):
            before = group.tensor_bytes()
            out[name] = (before, group.train(batch), group.tensor_bytes())
        trained = out["tp1"][2]
        tp1.save(str(out["saves"]["tp1"]), with_hf=False)
        tp2.load(str(out["saves"]["tp1"]))
        out["tp2_loaded"] = tp2.tensor_bytes()
        tp2.save(str(out["saves"]["tp2"]), with_hf=False)
        tp1.train(batch)
        out["tp1_moved_on"] = tp1.tensor_bytes() != trained
        tp1.load(str(out["saves"]["tp2"]))
        out["tp1_loaded_back"] = tp1.tensor_bytes()
        tp1.save(str(out["saves"]["back"]), with_hf=False)
        tp1.train(batch)
        tp2.train(batch)
        out["next"] = (tp1.tensor_bytes(), tp2.tensor_bytes())
    return out


def test_tp2_matches_tp1(tp1_and_tp2: dict, tiny_qwen3_dir: Path) -> None:
    base = checkpoint_tensors(tiny_qwen3_dir)
    base_bytes = {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in base.items()}
    tp1_before, tp1_result, tp1_after = tp1_and_tp2["tp1"]
    tp2_before, tp2_result, tp2_after = tp1_and_tp2["tp2"]
    tp1_metrics, tp2_metrics = tp1_result.summary(), tp2_result.summary()
    assert tp1_before == tp2_before == base_bytes  # same weights, same bytes, canonical names
    for key in ("train/pg_loss", "train/loss", "train/entropy", "train/train_rollout_logprob_abs_diff"):
        assert tp2_metrics[key] == pytest.approx(tp1_metrics[key], abs=1e-6), key
    assert tp1_metrics["train/ppo_kl_first_step"] == pytest.approx(0.0, abs=1e-7)
    assert tp1_metrics["train/pg_clipfrac_first_step"] == 0.0
    assert tp2_metrics["train/grad_norm"] == pytest.approx(tp1_metrics["train/grad_norm"], rel=1e-5)
    tp1, tp2 = as_tensors(tp1_after, base), as_tensors(tp2_after, base)
    for name in base:
        assert not torch.equal(tp1[name], base[name]), name  # every tensor (QK norms included) moved
        assert torch.allclose(tp2[name], tp1[name], atol=1e-4), name  # Adam amplifies float-order noise


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_two_data_parallel_ranks_match_one_fsdp_rank(pool, tiny_qwen3_dir: Path, per_token: bool) -> None:
    """Two DP ranks, each with its share of a ragged, masked global batch, give the gradient and
    the weights of one fsdp rank training on all of it. (``adam_eps`` 1: the first Adam step is
    ~ lr * g, so the weights show the gradient's scale, not only its sign.)"""
    base = checkpoint_tensors(tiny_qwen3_dir)
    flags = {"lr": 1.0, "adam_eps": 1.0, "clip_grad": 0.0, "global_batch_size": 4, "calculate_per_token_loss": per_token}
    _, megatron, megatron_after = train_group(pool, tiny_qwen3_dir, 2, train_backend="megatron", **flags)
    _, fsdp, fsdp_after = train_group(pool, tiny_qwen3_dir, 1, train_backend="fsdp", **flags)
    assert len(megatron.steps) == len(fsdp.steps) == 2
    for m, f in zip(megatron.steps, fsdp.steps):
        for key in ("train/pg_loss", "train/entropy", "train/ppo_kl"):
            assert m[key] == pytest.approx(f[key], abs=1e-5), key
        assert m["train/grad_norm"] == pytest.approx(f["train/grad_norm"], rel=1e-4)
    megatron_w, fsdp_w = as_tensors(megatron_after, base), as_tensors(fsdp_after, base)
    for name in base:
        assert not torch.equal(megatron_w[name], base[name]), name
        assert torch.allclose(megatron_w[name], fsdp_w[name], rtol=1e-3, atol=1e-6), name


# ---------------------------------------------------------------------- recomputation, dynamic batches, KL, resume


def train_variants(model_dir: str, save_dir: str) -> dict:
    """In a rank process hosting no group: the same two optimizer steps under several flag sets (TP=1)."""
    import torch.distributed as dist

    from miles_disagg.engines.launch import free_port
    from miles_disagg.distributed import init_distributed
    from miles_disagg.trainer.megatron.backend import MegatronBackend

    init_distributed(0, 1, "127.0.0.1", free_port())
    variants = {
        "plain": {},
        "recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        "dynamic": dict(use_dynamic_batch_size=True, max_tokens_per_gpu=10),
        "kl": dict(use_kl_loss=True, kl_loss_coef=0.5),
        "kl_watched": dict(use_kl_loss=True, kl_loss_coef=0.0),
        "gspo": dict(advantage_estimator="gspo", use_tis=True, use_opsm=True),
        "custom": dict(loss_type="custom_loss",  # miles' own policy loss, named as a miles line may name it
                       custom_loss_function_path="miles.backends.megatron_utils.loss.policy_loss_function"),
        # the engines' logprobs (-4.0) are the student's: a teacher at -3.5 gives a reverse KL of -0.5
        "opd": dict(use_opd=True, opd_type="sglang", opd_kl_coef=0.5, use_rollout_logprobs=True),
    }
    results = {}
    for name, flags in variants.items():
        config = TrainConfig(train_backend="megatron", lr=1e-2, global_batch_size=4, micro_batch_size=2, seed=0, **flags)
        backend = MegatronBackend(config, model_dir, rank=0, world_size=1)
        calls = []
        backend.gpt.decoder.layers[0].register_forward_hook(lambda *args: calls.append(1))
        batch = samples()
        for sample in batch if config.use_opd else []:
            sample.teacher_logprobs = [-3.5] * len(sample.response_ids)
        result = backend.train([batch[:4], batch[4:]])
        results[name] = {"metrics": result.summary(), "steps": result.steps, "layer_calls": len(calls),
                         "weights": {n: t.clone() for n, t in backend.named_tensors()}}
        if name == "plain":  # resume: a restored backend continues exactly as the original does
            backend.save_checkpoint(save_dir)
            backend.train([batch[:4]])
            restored = MegatronBackend(config, model_dir, rank=0, world_size=1)
            restored.load_checkpoint(save_dir)
            restored.train([batch[:4]])
            results["resume"] = [all(torch.equal(a, b) for (_, a), (_, b) in
                                     zip(backend.named_tensors(), restored.named_tensors()))]
    try:
        MegatronBackend(TrainConfig(train_backend="megatron", pipeline_model_parallel_size=2), model_dir,
                        rank=0, world_size=1)
    except Exception as exc:  # noqa: BLE001 - returned to the test, which checks the type
        results["pp_on_cpu"] = exc
    dist.destroy_process_group()
    return results


def test_recompute_dynamic_batches_kl_and_resume(pool, tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    from miles_disagg.types import ConfigError

    results = pool.run(train_variants, str(tiny_qwen3_dir), str(tmp_path / "save"))
    plain, recompute, dynamic, kl, watched = (results[k] for k in ("plain", "recompute", "dynamic", "kl", "kl_watched"))
    # 8 samples in micro-batches of 2: 4 frozen forwards, 4 training forwards, and with full
    # recomputation 4 more forwards of each layer during backward -- with the same result.
    assert plain["layer_calls"] == 8 and recompute["layer_calls"] == 12
    assert recompute["metrics"] == plain["metrics"]
    assert all(torch.equal(recompute["weights"][n], w) for n, w in plain["weights"].items())
    # A budget of 10 tokens fits one sample (7-10 tokens) per micro-batch: 8 + 8 forwards;
    # the token-weighted gradient is the same.
    assert dynamic["layer_calls"] == 16
    assert dynamic["metrics"]["train/grad_norm"] == pytest.approx(plain["metrics"]["train/grad_norm"], rel=1e-5)
    assert all(torch.allclose(dynamic["weights"][n], w, atol=1e-4) for n, w in plain["weights"].items())
    # The reference is the base policy: no KL on the first step, some after it, and it pulls the update.
    assert "train/kl_loss" not in plain["metrics"] and kl["metrics"]["train/kl_loss"] > 0
    assert kl["steps"][0]["train/kl_loss"] == 0.0  # miles' gate: the first step's policy is the reference
    assert any(not torch.allclose(kl["weights"][n], w, atol=1e-6) for n, w in plain["weights"].items())
    # --use-kl-loss --kl-loss-coef 0: the reference is loaded and KL logged, the update is unchanged
    assert watched["steps"][0]["train/kl_loss"] == 0.0 and watched["steps"][1]["train/kl_loss"] > 0
    assert all(torch.equal(watched["weights"][n], w) for n, w in plain["weights"].items())
    assert results["resume"] == [True]
    # GSPO (with TIS and OPSM) trains through the same loss: on-policy first step, another update
    gspo, custom = results["gspo"], results["custom"]
    assert gspo["steps"][0]["train/ppo_kl"] == 0.0 and gspo["steps"][0]["train/pg_clipfrac"] == 0.0
    assert gspo["steps"][1]["train/grad_norm"] > 0 and "train/opsm_clipfrac" in gspo["steps"][0]
    assert any(not torch.allclose(gspo["weights"][n], w, atol=1e-6) for n, w in plain["weights"].items())
    # --loss-type custom_loss with miles' policy_loss_function: the built-in loss's update
    assert custom["steps"][0]["train/pg_loss"] == pytest.approx(plain["steps"][0]["train/pg_loss"], abs=1e-6)
    assert all(torch.allclose(custom["weights"][n], w, atol=1e-6) for n, w in plain["weights"].items())
    # --use-opd: the teacher's logprobs reach megatron's micro-batches, its term the advantages
    assert [step["train/opd_reverse_kl"] for step in results["opd"]["steps"]] == pytest.approx([-0.5, -0.5], abs=1e-6)
    assert "train/opd_reverse_kl" not in plain["metrics"]
    assert isinstance(results["pp_on_cpu"], ConfigError) and "--pipeline-model-parallel-size" in str(results["pp_on_cpu"])


# ---------------------------------------------------------------------- distributed checkpointing across layouts


def saved_state(save_dir: Path) -> dict:
    """Every sharded tensor of a save as one global tensor (megatron's sharded keys), plus the
    common state rank 0 wrote (hyperparameters, the optimizer's step)."""
    return {**read_state(save_dir), "common": torch.load(save_dir / "state" / "common.pt", weights_only=False)}


def test_tp1_save_loads_into_tp2_and_back(tp1_and_tp2: dict, tiny_qwen3_dir: Path) -> None:
    """TP=1 trains a step and saves; TP=2 loads it (the same exported bytes; a save right after
    holds the same global model and optimizer tensors) and saves; TP=1, moved on by another step,
    loads the TP=2 save and is back to the first state exactly. A further step from there is
    the same step in both layouts (Adam's moments were carried over)."""
    trained, saves = tp1_and_tp2["tp1"][2], tp1_and_tp2["saves"]
    assert tp1_and_tp2["tp2_loaded"] == trained  # TP=1 -> TP=2: the same parameters, to the bit
    assert tp1_and_tp2["tp1_moved_on"]
    assert tp1_and_tp2["tp1_loaded_back"] == trained  # TP=2 -> TP=1
    first = saved_state(saves["tp1"])
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in first)
    assert first["common"]["optimizer"]["step"] == 1.0
    assert_same_state(first, saved_state(saves["tp2"]))  # every model and optimizer tensor, and the common state
    assert_same_state(first, saved_state(saves["back"]))
    base = checkpoint_tensors(tiny_qwen3_dir)
    next_tp1, next_tp2 = tp1_and_tp2["next"]
    after_tp1, after_tp2 = as_tensors(next_tp1, base), as_tensors(next_tp2, base)
    for name in base:
        assert torch.allclose(after_tp2[name], after_tp1[name], atol=1e-4), name
