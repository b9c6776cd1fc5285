"""``miles-disagg agent`` in front of SGLang's own HTTP app: the disk-delta update end to end.

The agent (a real subprocess) pulls a published version into its local checkpoint, then the
updater's activation goes through the agent to SGLang's app: pause, flush, the load naming
the slot that holds exactly that version, continue, and the version read back from
``/model_info``. Generation is proxied unchanged.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from miles_disagg.engines.client import EngineClient
from miles_disagg.engines.launch import launch_agent
from miles_disagg.engines.updater import DiskDeltaUpdater

pytestmark = pytest.mark.timeout(300)


def test_disk_delta_update_through_the_agent(sglang, manager, io_struct, tiny_qwen3_dir, tmp_path):
    from safetensors.torch import load_file

    from miles_disagg.weights.publisher import DeltaPublisher

    base = tmp_path / "base"
    shutil.copytree(tiny_qwen3_dir, base)
    store, local = tmp_path / "store", tmp_path / "host" / "ckpt"
    local.parent.mkdir()
    publisher = DeltaPublisher(store, base_dir=base)
    publisher.capture_baseline()
    tensors = load_file(str(next(base.glob("*.safetensors"))))
    changed = {name: t + 0.25 for name, t in sorted(tensors.items())[:3]}
    assert publisher.publish(changed.items()).ref.version == 1
    publisher.close()

    agent = launch_agent(sglang.url, local, log_path=tmp_path / "agent.log", base_dir=base, store_dirs=[store])
    try:
        updater = DiskDeltaUpdater([agent.url], store_dir=str(store), local_dirs=[str(local)], pause_mode="retract")
        try:
            report = updater.update(1)
        finally:
            updater.close()
        with EngineClient(agent.url) as client:
            assert client.version() == 1
            answer = client.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    finally:
        agent.stop()

    assert report.version == 1 and answer["meta_info"]["weight_version"] == "1"
    kinds = [type(o).__name__ if not isinstance(o, tuple) else o[0] for o in manager.received]
    activation = kinds[kinds.index("PauseGenerationReqInput"):kinds.index("ContinueGenerationReqInput") + 1]
    assert activation == ["PauseGenerationReqInput", "flush_cache", "UpdateWeightFromDiskReqInput",
                          "ContinueGenerationReqInput"]
    (pause,) = manager.of_type("PauseGenerationReqInput")
    assert pause.mode == "retract"
    (load,) = manager.of_type("UpdateWeightFromDiskReqInput")
    assert isinstance(load, io_struct.UpdateWeightFromDiskReqInput) and load.weight_version == "1"
    slot = load.model_path  # the agent names the slot holding exactly v1, never the flipping symlink
    assert Path(slot).parent == local.parent / "ckpt.slots"
    loaded = load_file(str(next(Path(slot).glob("*.safetensors"))))
    for name, t in changed.items():
        assert torch.equal(loaded[name], t)

