"""Megatron ``torch_dist`` checkpoints as miles passes them (``--ref-load``, the initial ``--load``).

A tiny Qwen3 is built as a megatron GPTModel on CPU (gloo), its weights changed, and saved with
megatron-core's ``dist_checkpointing`` in Megatron-LM's layout (tracker file + ``release/``), with
no helper process left behind (megatron's writer keeps one for asynchronous saves);
once with megatron's local layer names, once with the norm names Transformer Engine layers use
(as a checkpoint written on GPU has them). The megatron backend started from either holds
exactly those weights (its HF export equals the saved model's), and so does its KL reference.
A checkpoint that lacks a tensor is refused naming the flag.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import scaled

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'miles-disagg[megatron]')")

pytestmark = pytest.mark.timeout(300)

SCRIPT = r'''
import json, sys, warnings
warnings.simplefilter("ignore")
import torch


def main(hf_dir, out):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from miles_disagg.config.components import TrainConfig
    from miles_disagg.engines.launch import free_port
    from miles_disagg.distributed import init_distributed
    from miles_disagg.trainer.megatron.backend import MegatronBackend
    from miles_disagg.trainer.torch_dist import save_torch_dist, torch_dist_dir
    from miles_disagg.types import ConfigError

    init_distributed(0, 1, "127.0.0.1", free_port())
    source = MegatronBackend(TrainConfig(train_backend="megatron"), hf_dir, rank=0, world_size=1)
    with torch.no_grad():
        for i, p in enumerate(source.gpt.parameters()):
            p.add_(0.01 * (i + 1))
    expected = {n: t.clone() for n, t in source.named_tensors()}
    save_torch_dist(source.gpt, f"{out}/local")

    te_names = source.gpt.sharded_state_dict()  # as a Transformer Engine model names its fused norms
    for sharded in te_names.values():
        if isinstance(sharded, ShardedTensor):
            sharded.key = sharded.key.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
            sharded.key = sharded.key.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
    te_model = type("Model", (), {"sharded_state_dict": lambda self: te_names})()
    save_torch_dist(te_model, f"{out}/te")

    partial = {k: v for k, v in source.gpt.sharded_state_dict().items() if "final_layernorm" not in k}
    save_torch_dist(type("Model", (), {"sharded_state_dict": lambda self: partial})(), f"{out}/partial")

    import psutil

    result = {"is_torch_dist": [torch_dist_dir(f"{out}/{d}") is not None for d in ("local", "te")] +
              [torch_dist_dir(hf_dir) is not None],
              "processes_left_by_saves": [" ".join(c.cmdline()) for c in psutil.Process().children()]}
    for name in ("local", "te"):
        backend = MegatronBackend(TrainConfig(train_backend="megatron"), hf_dir, rank=0, world_size=1,
                                  initial_checkpoint=(f"{out}/{name}", "--load"))
        got = dict(backend.named_tensors())
        result[name] = all(torch.equal(got[n], expected[n]) for n in expected) and set(got) == set(expected)
    reference = MegatronBackend(TrainConfig(train_backend="megatron", use_kl_loss=True, kl_loss_coef=0.1,
                                            ref_load=f"{out}/te"), hf_dir, rank=0, world_size=1)
    result["reference"] = all(torch.equal(a, b) for a, b in zip(reference.ref.state_dict().values(),
                                                                 source.gpt.state_dict().values())
                              if torch.is_tensor(a))
    result["policy_is_base"] = all(torch.equal(a, b) for a, b in zip(dict(reference.named_tensors()).values(),
                                                                    dict(MegatronBackend(TrainConfig(train_backend="megatron"), hf_dir, rank=0, world_size=1).named_tensors()).values()))
    try:
        MegatronBackend(TrainConfig(train_backend="megatron"), hf_dir, rank=0, world_size=1,
                        initial_checkpoint=(f"{out}/partial", "--ref-load"))
        result["partial"] = "loaded"
    except ConfigError as exc:
        result["partial"] = [str(exc), list(exc.flags)]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


def test_torch_dist_checkpoints_load_into_the_megatron_backend(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "torch_dist_check.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tiny_qwen3_dir), str(tmp_path / "ckpts")],
                            capture_output=True, text=True, timeout=scaled(280), cwd=tmp_path)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    found = json.loads(lines[0].removeprefix("RESULT "))
    assert found["is_torch_dist"] == [True, True, False]
    assert found["processes_left_by_saves"] == []  # a synchronous save spawns no helper process
    assert found["local"] is True, "the policy started from a local-layer torch_dist checkpoint"
    assert found["te"] is True, "the policy started from a checkpoint with Transformer Engine norm names"
    assert found["reference"] is True and found["policy_is_base"] is True
    message, flags = found["partial"]
    assert "--ref-load" in flags and "final_layernorm" in message and "has no" in message
    assert (tmp_path / "ckpts" / "local" / "latest_checkpointed_iteration.txt").read_text() == "release"
