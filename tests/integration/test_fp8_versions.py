"""FP8 versions: a run whose base checkpoint is blockwise FP8 publishes every version as the FP8 form of
the trainer's full-precision weights, byte-identical to ``miles-disagg convert-fp8`` of the same weights,
from 1 or 2 publishing ranks; hosts apply and verify them through ``miles-disagg weights``."""

from __future__ import annotations

import json
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


def _truncate_tensor(version_dir: Path, name: str, cut: int) -> None:
    """Rewrite the version's payload file with ``cut`` bytes fewer of ``name``'s payload."""
    import struct

    path = next(p for p in version_dir.glob("*.safetensors"))
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header, body = json.loads(raw[8:8 + size]), raw[8 + size:]
    start, end = header[name]["data_offsets"]
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        a, b = entry["data_offsets"]
        if key == name:
            entry["data_offsets"], entry["shape"] = [a, b - cut], [b - cut - a]
        elif a >= end:
            entry["data_offsets"] = [a - cut, b - cut]
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body[:start] + body[start:end - cut] + body[end:])


def _relabel_dtype(version_dir: Path, name: str) -> None:
    index_path = version_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    entry = index["metadata"]["tensors"][name]
    entry["dtype"], entry["nbytes"] = "F8_E4M3", entry["nbytes"] // 4
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("corrupt", [_truncate_tensor, _relabel_dtype], ids=["scale-truncated", "scale-dtype-relabelled"])
def test_a_corrupted_fp8_version_is_refused_and_nothing_is_written(checkpoints, tmp_path, corrupt):
    from miles_disagg.weights.publisher import DeltaPublisher

    _, bf16, fp8 = checkpoints
    store = tmp_path / "store"
    publisher = DeltaPublisher(store, base_dir=fp8, encoding="overwrite")  # every changed scale has a payload
    publisher.capture_baseline()
    publisher.publish(trained(load_file(bf16 / "model.safetensors"), 1).items())
    publisher.close()
    scale = next(n for n in json.loads((store / "weight_v000001" / "model.safetensors.index.json").read_text())
                 ["metadata"]["tensors"] if n.endswith("weight_scale_inv"))
    args = (scale, 8) if corrupt is _truncate_tensor else (scale,)
    corrupt(store / "weight_v000001", *args)
    local = tmp_path / "host"
    result = cli("weights", "apply", "--store", str(store), "--base-dir", str(fp8), "--local-dir", str(local))
    assert result.returncode == 2, result.stderr
    assert "weight_scale_inv" in result.stderr and result.stderr.count("\n") <= 2
    assert not local.exists()
    verify = cli("weights", "verify", "--store", str(store), "--base-dir", str(fp8))
    assert verify.returncode == 2, verify.stdout + verify.stderr
