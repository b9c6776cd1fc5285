"""SGLang's own HTTP app (``sglang.srt.entrypoints.http_server.app``), in this process, with a fake
tokenizer manager behind it.

Everything between the socket and the tokenizer manager is SGLang's: its routes, its request
parsing into ``io_struct`` types (FastAPI over msgspec structs), its responses and status
codes. The fake stands where SGLang's ``TokenizerManager`` would (which talks to the scheduler
over ZMQ): it records every request object SGLang parsed from our bodies, answers the way the
tokenizer manager's methods do (``(success, message)`` tuples, ``FlushCacheReqOutput``, generate
outputs whose ``finish_reason`` is SGLang's own ``FINISH_*`` type), keeps the weight version,
and opens ``update_weights_from_tensor`` payloads with SGLang's own ``MultiprocessingSerializer``.
Served by uvicorn on 127.0.0.1 without SGLang's lifespan (which builds the OpenAI serving
layer from a live tokenizer).
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class _ModelConfig:
    hf_config: Any
    is_image_understandable_model: bool = False
    is_audio_understandable_model: bool = False


@dataclass
class FakeTokenizerManager:
    server_args: Any
    model_path: str
    version: str = "0"
    received: list = field(default_factory=list)
    tensors: list = field(default_factory=list)
    released: set = field(default_factory=set)
    is_generation: bool = True
    gracefully_exit: bool = False
    startup_time: float = 0.0
    last_receive_tstamp: float = 0.0
    rid_to_state: dict = field(default_factory=dict)
    routing: tuple[int, int] | None = None
    """``(layers, top_k)``: answer ``return_routed_experts`` (a server started with --enable-return-routed-experts)."""

    def __post_init__(self) -> None:
        from transformers import AutoConfig

        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.server_status = ServerStatus.Up
        self.served_model_name = self.model_path
        self.model_config = _ModelConfig(AutoConfig.from_pretrained(self.model_path))

    def of_type(self, name: str) -> list:
        return [obj for obj in self.received if type(obj).__name__ == name]

    def config_value(self, name: str):
        return self.version if name == "weight_version" else getattr(self.server_args, name, None)

    async def get_internal_state(self):
        return [{"memory_released": sorted(self.released)}]

    async def generate_request(self, obj, request=None):
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        self.received.append(obj)
        self.last_receive_tstamp = time.time()
        obj.normalize_batch_and_arguments()  # SGLang's own batch/argument validation
        batch = not obj.is_single
        outputs = []
        for i in range(obj.batch_size if batch else 1):
            params = obj.sampling_params[i] if batch else obj.sampling_params
            n = params.get("max_new_tokens", 128)
            ids = [7] * n
            meta = {"id": f"r{i}", "finish_reason": FINISH_LENGTH(length=n).to_json(), "prompt_tokens": 3,
                    "completion_tokens": n, "weight_version": self.version}
            if (obj.return_logprob[i] if batch else obj.return_logprob):
                meta["output_token_logprobs"] = [(-0.5, t, None) for t in ids]
                prompt = obj.input_ids[i] if batch else obj.input_ids
                start = obj.logprob_start_len[i] if batch else obj.logprob_start_len
                meta["input_token_logprobs"] = self._input_logprobs(prompt, start)
                meta.update(self._top_fields(prompt, start, n, obj.top_logprobs_num[i] if batch else obj.top_logprobs_num,
                                             obj.token_ids_logprob[i] if batch else obj.token_ids_logprob))
            if obj.return_routed_experts and self.routing is not None:
                prompt = obj.input_ids[i] if batch else obj.input_ids
                meta["routed_experts"] = self._routed_experts(len(prompt) + n, obj.routed_experts_start_len)
            outputs.append({"text": "x" * n, "output_ids": ids, "meta_info": meta})
        yield outputs if batch else outputs[0]

    @staticmethod
    def _input_logprobs(prompt: list[int], start: int) -> list[tuple]:
        """SGLang's input logprobs of ``prompt`` from ``start`` on (none for -1), as its tokenizer manager
        answers them: the first entry's logprob None; here the token at position p gets ``-p / 100``."""
        if start < 0:
            return []
        return [(None if p == start else -p / 100, prompt[p], None) for p in range(start, len(prompt))]

    @staticmethod
    def _top_fields(prompt: list[int], start: int, n: int, top_k: int, token_ids: list[int] | None) -> dict:
        """SGLang's top-k fields as its tokenizer manager shapes them (``detokenize_top_logprobs_tokens``:
        one list of ``(logprob, id, text)`` per position, None where a position has none): at input
        position p the top-k are ids 1..k with logprob ``-(p + id) / 10``, an asked id gets ``-id / 100``."""
        positions = range(start, len(prompt)) if start >= 0 else range(0)
        fields = {}
        if top_k:
            fields["input_top_logprobs"] = [None if p == start else [(-(p + t) / 10, t, None) for t in range(1, top_k + 1)]
                                            for p in positions]
            fields["output_top_logprobs"] = [[(-t / 10, t, None) for t in range(1, top_k + 1)] for _ in range(n)]
        if token_ids is not None:
            fields["input_token_ids_logprobs"] = [None if p == start else [(-t / 100, t, None) for t in token_ids]
                                                  for p in positions]
            fields["output_token_ids_logprobs"] = [[(-t / 100, t, None) for t in token_ids] for _ in range(n)]
        return fields

    def _routed_experts(self, seqlen: int, start_len: int) -> str:
        """Routing of positions ``[start_len, seqlen - 1)`` (value: ``position * 100 + layer * 10 + k``),
        encoded as SGLang's tokenizer manager encodes a captured int32 tensor."""
        import pybase64
        import torch

        layers, top_k = self.routing
        rows = torch.tensor([[[p * 100 + layer * 10 + k for k in range(top_k)] for layer in range(layers)]
                             for p in range(start_len, seqlen - 1)], dtype=torch.int32)
        return pybase64.b64encode(rows.numpy().tobytes()).decode("utf-8")

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.received.append(("abort", rid, abort_all))

    def create_abort_task(self, obj):
        return None

    async def pause_generation(self, obj):
        self.received.append(obj)

    async def continue_generation(self, obj):
        self.received.append(obj)

    async def flush_cache(self, timeout_s: float = 0.0):
        from sglang.srt.managers.io_struct import FlushCacheReqOutput

        self.received.append(("flush_cache", timeout_s))
        return FlushCacheReqOutput(success=True)

    async def load_lora_adapter(self, obj, request=None):
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        self.received.append(obj)
        return LoRAUpdateOutput(success=True, loaded_adapters={obj.lora_name: obj.lora_path})

    async def unload_lora_adapter(self, obj, request=None):
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        self.received.append(obj)
        return LoRAUpdateOutput(success=True, loaded_adapters={})

    async def update_weight_version(self, obj):
        self.received.append(obj)
        self.version = obj.new_version

    async def update_weights_from_disk(self, obj, request=None):
        self.received.append(obj)
        if obj.weight_version is not None:
            self.version = obj.weight_version
        return True, "Succeeded to update model weights.", 0

    async def init_weights_update_group(self, obj, request=None):
        self.received.append(obj)
        return True, "Succeeded to initialize custom process group."

    async def destroy_weights_update_group(self, obj, request=None):
        self.received.append(obj)
        return True, "Succeeded to destroy custom process group."

    async def update_weights_from_distributed(self, obj, request=None):
        self.received.append(obj)
        if obj.weight_version is not None:
            self.version = obj.weight_version
        return True, "Succeeded to update parameter online."

    async def update_weights_from_tensor(self, obj, request=None):
        from sglang.srt.utils import MultiprocessingSerializer

        self.received.append(obj)
        for entry in obj.serialized_named_tensors:  # SGLang's own (restricted) unpickling of our payload
            self.tensors.append(MultiprocessingSerializer.deserialize(entry))
        if obj.weight_version is not None:
            self.version = obj.weight_version
        return True, "Success"

    async def begin_weight_update(self, obj, request=None):
        self.received.append(obj)
        return True, "Success"

    async def end_weight_update(self, obj, request=None):
        self.received.append(obj)
        return True, "Success"

    async def release_memory_occupation(self, obj, request=None):
        self.received.append(obj)
        self.released |= set(obj.tags or ["kv_cache", "weights", "cuda_graph"])

    async def resume_memory_occupation(self, obj, request=None):
        self.received.append(obj)
        self.released -= set(obj.tags or ["kv_cache", "weights", "cuda_graph"])


def server_args_for(model_dir: Path, argv: list[str] | None = None):
    """SGLang's ``ServerArgs`` for the model, parsed by SGLang's parser (CPU device: nothing here has a GPU)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(
        ["--model-path", str(model_dir), "--weight-version", "0", "--device", "cpu", *(argv or [])]))


class SGLangApp:
    """SGLang's app on 127.0.0.1 with a :class:`FakeTokenizerManager`; ``stop()`` when done."""

    def __init__(self, model_dir: Path):
        import uvicorn

        from sglang.srt.entrypoints import http_server
        from sglang.srt.runtime_context import publish

        server_args = server_args_for(model_dir)
        publish(server_args, role="tokenizer")
        self.manager = FakeTokenizerManager(server_args, str(model_dir))
        http_server.set_global_state(http_server._GlobalState(
            tokenizer_manager=self.manager, template_manager=None, scheduler_info={}))
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(http_server.app, host="127.0.0.1", port=port, lifespan="off",
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("SGLang's app did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
