"""The engine behind the HTTP API: tokenizer, scheduler, staged and broadcast weight updates.

Blocking methods here are called from worker threads by the HTTP layer; anything that
touches the running batch or the live weights goes through ``Scheduler.call`` and so
runs between two decode steps.

Failure contract for every weight update: the new tensors are read and checked in full
before the swap, the swap is a pointer assignment per tensor, and the reported version
changes only after the swap; a failure anywhere leaves the live weights and version
as they were.

Where this differs from SGLang (documented, deliberate):

* An update sent while generation is *not* paused is applied between two decode steps;
  in-flight requests keep their KV and continue on the new weights (like ``in_place``),
  reporting ``weight_version_start != weight_version_end``. SGLang instead waits for
  in-flight requests to drain. ``abort_all_requests=true`` aborts them first, as in SGLang.
* ``update_weights_from_disk`` whose ``weight_version`` names the version staged by
  ``/pull_weights`` activates the staged tensors whatever ``model_path`` says (the pulled
  checkpoint is the one that was verified); otherwise ``model_path`` is read from disk.
* Accepted and ignored: ``load_format``, ``is_async``, ``keep_pause``, ``torch_empty_cache``,
  ``recapture_cuda_graph``, ``token_step``, ``flush_cache`` (there is no prefix cache to flush).
* Versions are strings as in SGLang (ints are accepted and reported as decimal strings);
  the start-up default is ``"0"`` (this project's base version), not SGLang's ``"default"``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from miles_disagg.engine.dist_update import DistUpdater
from miles_disagg.engine.model_runner import ModelRunner
from miles_disagg.engine.protocol import (
    DistributedUpdate, FinishReason, GenerateItem, GenerateRequest, InitGroup, PullWeights, UpdateFromDisk,
)
from miles_disagg.engine.scheduler import Scheduler, Sequence, Sink
from miles_disagg.engine.staging import Stager, version_ref_from_string
from miles_disagg.types import InvalidInput
from miles_disagg.weights.hooks import PRE_READ_FLAG, load_hook

log = logging.getLogger(__name__)

ENGINE_VERSION = "miles-disagg-builtin-0.1.0"


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Settings of one built-in engine process."""

    model_path: Path
    """HF causal LM checkpoint directory (config.json, safetensors, tokenizer files)."""
    host: str = "127.0.0.1"
    """Address the HTTP server binds (loopback unless told otherwise)."""
    port: int = 30000
    """HTTP port."""
    weight_version: str = "0"
    """Version reported before any update (SGLang's default is "default"; this project's base is 0)."""
    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    dtype: str = "auto"
    """``auto`` (the checkpoint's), ``float32`` or ``bfloat16``."""
    max_running_requests: int = 64
    """Most requests decoded together in one batch; the rest wait in the queue."""
    random_seed: int = 0
    """Seeds the generators of requests without ``sampling_seed``."""
    pull_weights_pre_read_hook: str | None = None
    """``module:function`` called as ``hook(source_dir, target_version)`` before a pull reads a version."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")


class Engine:
    """One model, one scheduler thread; see the module docstring for the update contract."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoTokenizer

        self.config = config
        self.runner = ModelRunner(config.model_path, device=config.device, dtype=config.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(str(config.model_path))
        self.stop_ids = frozenset(self._eos_ids())
        self.scheduler = Scheduler(
            self.runner, version=config.weight_version, max_running=config.max_running_requests,
            seed=config.random_seed, stop_text=self._matched_stop_text,
        )
        self.stager = Stager(self.runner, config.model_path, version_ref_from_string(config.weight_version),
                             pre_read_hook=load_hook(config.pull_weights_pre_read_hook, PRE_READ_FLAG))
        self.dist = DistUpdater(self.runner.device)
        self.weights_path = Path(config.model_path)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.scheduler.start()
        self._warm_up()

    def stop(self) -> None:
        self.scheduler.stop()

    def _warm_up(self) -> None:
        """One prefill + a few decode steps so the first real request does not pay for set-up."""
        self.runner.prefill([[0, 1, 2], [3]])
        logits, kv = self.runner.prefill([[4, 5]])
        for _ in range(2):
            self.runner.decode(kv, [int(logits[0].argmax())])

    @property
    def version(self) -> str:
        return self.scheduler.version

    # ------------------------------------------------------------------ generation

    def make_sequences(self, request: GenerateRequest, make_sink: Callable[[GenerateItem], Sink]) -> list[Sequence]:
        """Tokenize and validate every item first: a bad item rejects the whole request."""
        prompts = [self._prompt_ids(item) for item in request.items]
        return [
            Sequence(
                item=item, prompt_ids=prompt, generator=self.scheduler.new_generator(item.sampling.sampling_seed),
                sink=make_sink(item), stop_ids=self.stop_ids,
            )
            for item, prompt in zip(request.items, prompts)
        ]

    def submit(self, seq: Sequence) -> None:
        if seq.item.sampling.max_new_tokens == 0:
            seq.version_start = seq.version_end = self.version
            seq.finish = FinishReason("length", {"length": 0})
            seq.sink.on_finish(seq)
            return
        self.scheduler.submit(seq)

    def _prompt_ids(self, item: GenerateItem) -> list[int]:
        if item.input_ids is not None:
            ids = list(item.input_ids)
            bad = [t for t in ids if not 0 <= t < self.runner.vocab_size]
            if bad:
                raise InvalidInput(f"input_ids holds token ids outside [0, {self.runner.vocab_size}): {bad[:5]}")
        else:
            ids = self.tokenizer.encode(item.text, add_special_tokens=False)
        if not ids:
            raise InvalidInput("the prompt is empty")
        total = len(ids) + item.sampling.max_new_tokens
        if total > self.runner.max_context:
            raise InvalidInput(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({item.sampling.max_new_tokens}) = {total} "
                f"exceeds the model's context length {self.runner.max_context}"
            )
        return ids

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.runner.model, "generation_config", None), self.runner.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update([value] if isinstance(value, int) else list(value or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def _matched_stop_text(self, seq: Sequence) -> str | None:
        stops = seq.item.sampling.stop
        tail = seq.output_ids[-(max(len(s) for s in stops) + 2):]
        text = self.tokenizer.decode(tail, skip_special_tokens=seq.item.sampling.skip_special_tokens)
        return next((s for s in stops if s in text), None)

    def result_json(self, seq: Sequence) -> dict:
        """SGLang's ``/generate`` response object for a sequence (finished or not)."""
        params = seq.item.sampling
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=params.skip_special_tokens)
        matched = seq.finish.extra.get("matched") if seq.finish else None
        if isinstance(matched, str) and not params.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        meta = {
            "id": seq.rid,
            "finish_reason": seq.finish.to_json() if seq.finish else None,
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": 0,
            "weight_version": seq.version_end,
            "weight_version_start": seq.version_start,
            "weight_version_end": seq.version_end,
            "num_retractions": seq.num_retractions,
            "e2e_latency": round(time.monotonic() - seq.created_s, 6),
        }
        if seq.item.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.output_logprobs, seq.output_ids)]
        return {"text": text, "output_ids": list(seq.output_ids), "meta_info": meta}

    # ------------------------------------------------------------------ pause / abort / versions

    def pause(self, mode: str) -> int:
        return self.scheduler.call(lambda s: s.pause(mode)).result()

    def resume(self) -> None:
        self.scheduler.call(lambda s: s.resume()).result()

    def abort(self, rid: str, abort_all: bool) -> None:
        if abort_all:
            self.scheduler.call(lambda s: s.abort_all("aborted by abort_request")).result()
        elif rid:
            self.scheduler.call(lambda s: s.abort(rid, "aborted by abort_request")).result()

    def abort_async(self, rid: str) -> None:
        """Fire-and-forget abort (a disconnected client); never blocks the caller."""
        self.scheduler.call(lambda s: s.abort(rid, "client disconnected"))

    def flush_cache(self) -> bool:
        return self.scheduler.call(lambda s: s.can_flush()).result()

    def set_version(self, version: str, abort_all: bool) -> None:
        def apply(s: Scheduler) -> None:
            if abort_all:
                s.abort_all("aborted by update_weight_version")
            s.version = version
            self.stager.set_live(version_ref_from_string(version))

        self.scheduler.call(apply).result()

    # ------------------------------------------------------------------ weight updates

    def update_from_disk(self, req: UpdateFromDisk) -> dict:
        """Activate the staged version named ``weight_version`` if there is one, else reload
        ``model_path`` from disk (read and checked in the pause, before anything is swapped)."""
        staged = self.stager.take(req.weight_version)
        if staged is None:
            self.runner.check_compatible(Path(req.model_path))

        def activate(s: Scheduler) -> dict:
            start = time.perf_counter()
            num_paused = len(s.running) + len(s.waiting) if s.paused_mode else 0
            if req.abort_all_requests:
                s.abort_all("aborted by update_weights_from_disk(abort_all_requests=true)")
            if staged is not None:
                self.runner.swap_in(staged.tensors)
                live_ref, self.weights_path = staged.ref, staged.path
            else:
                self.runner.swap_in(self.runner.load_tensors(Path(req.model_path)))
                live_ref, self.weights_path = None, Path(req.model_path)
            if req.weight_version is not None:
                s.version = req.weight_version
                live_ref = live_ref or version_ref_from_string(req.weight_version)
            self.stager.set_live(live_ref if staged is not None or req.weight_version is not None else None)
            pause_ms = (time.perf_counter() - start) * 1e3
            return {"num_paused_requests": num_paused, "pause_ms": round(pause_ms, 3)}

        try:
            result = self.scheduler.call(activate).result()
        except BaseException:
            if staged is not None:  # keep it staged for a retry
                self.stager.staged = self.stager.staged or staged
            raise
        how = "staged" if staged is not None else "disk"
        log.info("activated weights (%s) version=%s pause=%.1f ms", how, self.version, result["pause_ms"])
        return {
            "success": True,
            "message": f"Succeeded to update model weights ({how} activation, pause {result['pause_ms']:.1f} ms).",
            "num_paused_requests": result["num_paused_requests"],
            "weight_version": self.version,
            "activation": how,
            "pause_ms": result["pause_ms"],
        }

    def pull_weights(self, req: PullWeights) -> dict:
        """Materialize + verify + stage (blocking, off the scheduler thread)."""
        try:
            staged = self.stager.pull(Path(req.source_dir), req.target_version, Path(req.local_checkpoint_dir))
        except OSError as exc:  # the paths the caller named are unusable; nothing was staged or activated
            raise InvalidInput(f"pull of version {req.target_version} failed: {type(exc).__name__}: {exc}") from exc
        return {
            "success": True,
            "message": f"Prepared version {staged.ref.version}; activate it with update_weights_from_disk",
            **staged.summary(),
        }

    def init_weights_update_group(self, req: InitGroup) -> dict:
        backend = self.dist.init_group(req)
        return {"success": True, "message": f"Succeeded to initialize group {req.group_name!r} ({backend})."}

    def update_from_distributed(self, req: DistributedUpdate) -> dict:
        tensors = self.dist.receive(req, self.runner.params)

        def activate(s: Scheduler) -> float:
            start = time.perf_counter()
            if req.abort_all_requests:
                s.abort_all("aborted by update_weights_from_distributed(abort_all_requests=true)")
            self.runner.swap_in(tensors)
            if req.weight_version is not None:
                s.version = req.weight_version
            self.stager.set_live(version_ref_from_string(req.weight_version) if req.weight_version else None)
            return (time.perf_counter() - start) * 1e3

        pause_ms = self.scheduler.call(activate).result()
        return {"success": True, "message": "Succeeded to update parameter online.", "pause_ms": round(pause_ms, 3)}

    # ------------------------------------------------------------------ info

    def model_info(self) -> dict:
        return {
            "model_path": str(self.config.model_path),
            "tokenizer_path": str(self.config.model_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(self.runner.config, "model_type", None),
            "architectures": list(getattr(self.runner.config, "architectures", None) or []),
        }

    def server_info(self) -> dict:
        s = self.scheduler
        return {
            "model_path": str(self.config.model_path),
            "tokenizer_path": str(self.config.model_path),
            "host": self.config.host,
            "port": self.config.port,
            "device": self.config.device,
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "max_running_requests": self.config.max_running_requests,
            "random_seed": self.config.random_seed,
            "context_length": self.runner.max_context,
            "weight_version": self.version,
            "version": ENGINE_VERSION,
            "internal_states": [{
                "paused_mode": s.paused_mode,
                "num_running_requests": len(s.running),
                "num_waiting_requests": s.num_waiting,
                "num_steps": s.num_steps,
                "num_aborted_requests": s.num_aborted,
                "staged_version": self.stager.staged_version(),
                "weights_path": str(self.weights_path),
            }],
        }
