"""FP8 versions: a run whose base checkpoint is blockwise FP8 publishes every version as the FP8 form of
the trainer's full-precision weights, byte-identical to ``miles-disagg convert-fp8`` of the same weights,
from 1 or 2 publishing ranks; hosts apply and verify them through ``miles-disagg weights``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_disagg.bench.publish import publish_with_ranks
from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3
from deadlines import scaled

pytestmark = pytest.mark.integration
BLOCK = ["16", "16"]


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_disagg.cli", *argv], capture_output=True, text=True,
                          timeout=300)


def convert(model_dir: Path, save_dir: Path) -> None:
    result = cli("convert-fp8", "--model-dir", str(model_dir), "--save-dir", str(save_dir), "--block-size", *BLOCK)
    assert result.returncode == 0, result.stderr


def trained(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """A small AdamW-like update of every weight (deterministic per step)."""
    gen = torch.Generator().manual_seed(step)
    return {n: (t.float() + 1e-3 * torch.randn(t.shape, generator=gen)).to(t.dtype) for n, t in state.items()}


def write_checkpoint(like: Path, state: dict[str, torch.Tensor], out: Path) -> Path:
    out.mkdir()
    for path in like.iterdir():
        if path.suffix != ".safetensors":
            (out / path.name).write_bytes(path.read_bytes())
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def served_files(directory: Path) -> dict[str, bytes]:
    tensors = {}
    for path in directory.glob("*.safetensors"):
        tensors.update(load_file(path))
    return {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    bf16 = make_tiny_qwen3(root / "bf16", dtype="bfloat16", num_experts=4, hidden_size=48, intermediate_size=80)
    convert(bf16, root / "fp8")
    return root, bf16, root / "fp8"


def publish(store: Path, base: Path, states: list[Path], ranks: int) -> None:
    """One version per trained checkpoint, each written by ``ranks`` processes (gloo)."""
    for trained_dir in states:
        report = publish_with_ranks(base, trained_dir, store, ranks, timeout_s=scaled(300))
        assert report["version"] >= 1


@pytest.mark.parametrize("ranks", [1, 2])
def test_an_applied_fp8_version_equals_convert_fp8_of_the_trainers_weights(checkpoints, tmp_path, ranks):
    root, bf16, fp8 = checkpoints
    base_state = load_file(bf16 / "model.safetensors")
    states = [trained(base_state, 1), trained(trained(base_state, 1), 2)]
    dirs = [write_checkpoint(bf16, state, tmp_path / f"trained-{i}") for i, state in enumerate(states)]
    store = tmp_path / "store"
    publish(store, fp8, dirs, ranks)

    expected = tmp_path / "trained-fp8"
    convert(dirs[-1], expected)
    local = tmp_path / "local"
    result = cli("weights", "apply", "--store", str(store), "--base-dir", str(fp8), "--local-dir", str(local))
    assert result.returncode == 0, result.stderr
    assert served_files(local) == served_files(expected)
    verify = cli("weights", "verify", "--store", str(store), "--base-dir", str(fp8))
    assert verify.returncode == 0, verify.stdout + verify.stderr
