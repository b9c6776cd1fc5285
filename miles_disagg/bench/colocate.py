"""``miles-disagg bench colocate``: does ``--colocate`` really hand memory over (on CPU)?

Makes a random Qwen3 (float32; default ~100M parameters, `--hidden-size`, `--num-layers`) in a temp dir and measures two processes' RSS:

* the engine (the built-in engine as a subprocess): before and after
  ``/release_memory_occupation`` (every tag), then after ``/resume_memory_occupation`` and a
  reload of the trainer's weights by ``/update_weights_from_tensor`` (shared-memory handles),
  checked by a greedy generation against the weights sent;
* the trainer (this process: the HF model and AdamW after one optimizer step, offloaded by
  the same ``HostOffloader`` the trainer ranks use): before and after offloading parameters,
  gradients and optimizer state, and whether onload restored them bit for bit.

``checks`` says whether the engine's RSS dropped by at least the weights' size and the
trainer's by at least its optimizer state. Prints one JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.bench.common import print_result, progress, qwen3_shape, work_dir
from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import flag

MIB = float(1 << 20)


@dataclass(kw_only=True)
class ColocateBench:
    """colocation memory handoff: engine and trainer RSS while released / offloaded"""

    json: bool = flag(False, "Print the result as JSON (always on; kept for scripts).")
    hidden_size: int = flag(768, "Hidden size of the random Qwen3 (a multiple of 64; 768: ~100M parameters).")
    num_layers: int = flag(12, "Layers of the random Qwen3.")
    work_dir: Path | None = flag(None, "Keep the model here (default: a temp dir).")

    def __post_init__(self) -> None:
        qwen3_shape(self.hidden_size, self.num_layers)  # ValueError naming the flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ColocateBench)


_progress = progress("colocate")


def run(args: argparse.Namespace) -> int:
    command = config_from_args(ColocateBench, args)
    with work_dir("colocate", command.work_dir) as root:
        result = _bench(root, command)
    return print_result(result)


def _bench(root: Path, command: ColocateBench) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    torch.set_num_threads(2)
    _progress("making the model")
    model_dir = make_tiny_qwen3(root / "model", **qwen3_shape(command.hidden_size, command.num_layers))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    optimizer = _one_step(model)
    engine = _engine_side(model_dir, root, model, weights_bytes)
    trainer = _trainer_side(model, optimizer)
    return {
        "model_params": sum(p.numel() for p in model.parameters()),
        "weights_mib": round(weights_bytes / MIB, 1),
        "engine": engine,
        "trainer": trainer,
        "checks": {"engine_rss_drop_ge_weights": engine["rss_drop_mib"] >= weights_bytes / MIB,
                   "trainer_rss_drop_ge_optimizer_state": trainer["rss_drop_mib"] >= trainer["optimizer_mib"],
                   "engine_serves_the_weights_sent": engine["serves_the_weights_sent"],
                   "trainer_onload_exact": trainer["onload_exact"]},
    }


def _one_step(model):
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return optimizer


def _engine_side(model_dir: Path, root: Path, model, weights_bytes: int) -> dict:
    import psutil

    from miles_disagg.engines.client import EngineClient
    from miles_disagg.engines.launch import launch_engine
    from miles_disagg.trainer.colocated import push_named_tensors

    _progress("starting the engine")
    launched = launch_engine(model_dir, log_path=root / "engine.log", extra_args=["--dtype", "float32"])
    process = psutil.Process(launched.proc.pid)
    client = EngineClient(launched.url)
    prompt = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                                              "ignore_eos": True}}
    try:
        client.generate(prompt)
        before = process.memory_info().rss
        client.release_memory(None)
        released = process.memory_info().rss
        _progress(f"engine RSS {before / MIB:.0f} MiB -> {released / MIB:.0f} MiB released")
        client.resume_memory(["weights"])
        start = time.perf_counter()
        pushed = push_named_tensors([launched.url], model.state_dict().items(), 1, 512 << 20)
        push_s = time.perf_counter() - start
        client.resume_memory(["kv_cache", "cuda_graph"])
        served = client.generate(prompt)["output_ids"]
        after = process.memory_info().rss
    finally:
        client.close()
        launched.stop()
    return {"rss_before_mib": round(before / MIB, 1), "rss_released_mib": round(released / MIB, 1),
            "rss_drop_mib": round((before - released) / MIB, 1),
            "rss_drop_over_weights": round((before - released) / weights_bytes, 3),
            "rss_after_reload_mib": round(after / MIB, 1), "push_s": round(push_s, 3),
            "pushed_mib": round(pushed["bytes"] / MIB, 1),
            "serves_the_weights_sent": served == _greedy(model, prompt)}


def _greedy(model, prompt: dict) -> list[int]:
    import torch

    ids = torch.tensor([prompt["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=prompt["sampling_params"]["max_new_tokens"], do_sample=False,
                             min_new_tokens=prompt["sampling_params"]["max_new_tokens"])
    return out[0, ids.shape[1]:].tolist()


def _trainer_side(model, optimizer) -> dict:
    import psutil
    import torch

    from miles_disagg.trainer.offload import HostOffloader

    process = psutil.Process()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    state_ref = [{k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)} for s in optimizer.state.values()]
    before = process.memory_info().rss
    offloader = HostOffloader(torch.device("cpu"))
    start = time.perf_counter()
    sizes = offloader.offload(model, optimizer)
    offload_s = time.perf_counter() - start
    offloaded = process.memory_info().rss
    _progress(f"trainer RSS {before / MIB:.0f} MiB -> {offloaded / MIB:.0f} MiB offloaded")
    start = time.perf_counter()
    offloader.onload()
    onload_s = time.perf_counter() - start
    exact = all(torch.equal(reference[k], v) for k, v in model.state_dict().items()) and all(
        torch.equal(ref[k], state[k]) for ref, state in zip(state_ref, optimizer.state.values()) for k in ref)
    return {"params_mib": round(sizes["params"] / MIB, 1), "optimizer_mib": round(sizes["optimizer"] / MIB, 1),
            "grads_mib": round(sizes["grads"] / MIB, 1), "rss_before_mib": round(before / MIB, 1),
            "rss_offloaded_mib": round(offloaded / MIB, 1), "rss_drop_mib": round((before - offloaded) / MIB, 1),
            "offload_s": round(offload_s, 3), "onload_s": round(onload_s, 3), "onload_exact": exact}
