"""The engine behind the HTTP API: tokenizer, scheduler, generation, pause/abort, colocation, info.

Blocking methods here are called from worker threads by the HTTP layer; anything that
touches the running batch or the live weights goes through ``Scheduler.call`` and so
runs between two decode steps. Weight updates (staged pulls, activations, broadcast and
in-memory updates, version labels) are ``Engine.updates``, a
:class:`~miles_disagg.engines.builtin.weight_updates.WeightUpdates`; its module states their
failure contract (a failure anywhere leaves the live weights and version as they were).

Where this differs from SGLang (documented, deliberate):

* An update sent while generation is *not* paused is applied between two decode steps;
  in-flight requests keep their KV and continue on the new weights (like ``in_place``),
  reporting ``weight_version_start != weight_version_end``. SGLang instead waits for
  in-flight requests to drain. ``abort_all_requests=true`` aborts them first, as in SGLang.
* ``update_weights_from_disk`` whose ``weight_version`` names the version staged by
  ``/pull_weights`` activates the staged tensors whatever ``model_path`` says (the pulled
  checkpoint is the one that was verified); otherwise ``model_path`` is read from disk, and it
  must be the base checkpoint or the engine's local checkpoint (``--local-checkpoint-dir``);
  any other path is 403 naming the allowed roots. Version labels come only from verified
  weights: the label must be the version the loaded checkpoint holds (the base: 0; the local
  checkpoint: the version its last verified pull recorded; no label: that version), and
  ``/update_weight_version`` is refused (403) unless it names the version already live. A
  stock SGLang relabels freely; ``--allow-unverified-versions`` restores that, for tests only.
* ``/pull_weights`` reads only a ``--weight-store-dir`` and writes only ``--local-checkpoint-dir``
  (``local_checkpoint_dir`` may be left out: it is that one); anything else is 403.
* A ``text`` prompt longer than the context could ever hold (context length x the longest
  vocabulary entry) is refused before it is tokenized; parsing and tokenizing run off the
  event loop.
* ``/begin_weight_update`` and ``/end_weight_update`` (miles' SGLang branch) only acknowledge;
  sampling knobs this engine does not implement (``n``, penalties, ``min_new_tokens``,
  constrained decoding) are refused with 400 unless they carry their no-op value.
* A request id already in flight is refused (400); a string ``rid`` for a batch is a prefix
  (``rid_0``, ``rid_1``, ...), as in SGLang.
* Accepted and ignored: ``load_format``, ``is_async``, ``keep_pause``, ``torch_empty_cache``,
  ``recapture_cuda_graph``, ``token_step``; ``flush_cache`` on an update is moot (every swap of the
  weights drops the prefix cache, :mod:`.prefix_cache`).
* ``return_routed_experts`` (with ``--enable-return-routed-experts``, mixture-of-experts models) is
  refused with ``max_new_tokens=0``: such requests are answered without a forward pass.
* Versions are strings as in SGLang (ints are accepted and reported as decimal strings);
  the start-up default is ``"0"`` (this project's base version), not SGLang's ``"default"``.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from miles_disagg.engines.activation import ONE_CALL_ANNOUNCEMENT
from miles_disagg.engines.builtin.config import EngineConfig
from miles_disagg.engines.builtin.lora import resident_versions
from miles_disagg.engines.builtin.memory import MemoryState
from miles_disagg.engines.builtin.model_runner import ModelRunner
from miles_disagg.engines.builtin.protocol import (
    FinishReason, GenerateItem, GenerateRequest, check_logprob_start_len, check_reported_logprobs)
from miles_disagg.engines.builtin.response import result_json
from miles_disagg.engines.builtin.scheduler import Scheduler
from miles_disagg.engines.builtin.sequence import Sequence, Sink
from miles_disagg.engines.builtin.weight_updates import WeightUpdates
from miles_disagg.types import ConfigError, EngineUnrecoverable, InvalidInput

log = logging.getLogger(__name__)

ENGINE_VERSION = "miles-disagg-builtin-0.1.0"

# SGLang ``server_args`` keys a client may compare (miles checks an external engine's layout):
# this engine is one process on one device.
ANNOUNCEMENT = {"pull_weights": True, "delta_filters": ["byteplane", "none"], "weight_checksums": True,
                **ONE_CALL_ANNOUNCEMENT}
"""What ``/get_server_info`` announces under ``miles_disagg``: this engine reads byte-plane
deltas (so a job may publish them), serves ``/weight_checksums`` and activates a prepared version
in one call (``/activate_weights``; its ``/pull_weights`` answer says so too)."""

_SINGLE_PROCESS_SERVER_ARGS = {"tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0}


class _ReleasingSink:
    """Forwards to the HTTP sink and frees the request id (and its LoRA adapter) when the sequence finishes."""

    def __init__(self, inner: Sink, release: Callable[[Sequence], None]):
        self.inner, self.release = inner, release

    def on_token(self, seq: Sequence) -> None:
        self.inner.on_token(seq)

    def on_finish(self, seq: Sequence) -> None:
        self.release(seq)
        self.inner.on_finish(seq)


class Engine:
    """One model, one scheduler thread; see the module docstring for the update contract."""

    def __init__(self, config: EngineConfig):
        from miles_disagg.models.tokenizer import load_tokenizer

        self.config = config
        self.runner = ModelRunner(config.model_path, device=config.device, dtype=config.dtype)
        if config.enable_return_routed_experts and not self.runner.is_moe:
            raise ConfigError(f"--enable-return-routed-experts: the model at {str(config.model_path)!r} has no "
                              f"experts (model_type {self.runner.config_json.get('model_type')!r})",
                              ("--enable-return-routed-experts",))
        self.tokenizer = load_tokenizer(config.model_path)
        self.stop_ids = frozenset(self._eos_ids())
        self.scheduler = Scheduler(
            self.runner, version=config.weight_version, max_running=config.max_running_requests,
            seed=config.random_seed, stop_text=self._matched_stop_text,
            prefix_cache_tokens=config.prefix_cache_tokens, lora=self._lora_bank(config),
        )
        self.memory = MemoryState()  # colocation: released tags (see engines/builtin/memory.py)
        self.updates = WeightUpdates(config, self.runner, self.scheduler, self.memory)
        self.max_prompt_chars = _max_prompt_chars(self.tokenizer, self.runner.max_context)
        # a batch may queue beyond the running set; past this many prompt tokens a request is refused unparsed
        self.max_request_tokens = REQUEST_BATCHES * config.max_running_requests * self.runner.max_context
        self._rid_lock = threading.Lock()
        self._live_rids: set[str] = set()

    def _lora_bank(self, config: EngineConfig):
        if not config.enable_lora:
            return None
        from miles_disagg.engines.builtin.lora import AdapterVersions, LoraBank

        bank = LoraBank(self.runner.model, max_loaded=config.max_loaded_loras, max_rank=config.max_lora_rank,
                        roots=config.lora_roots)
        if config.lora_base_dir is not None:
            bank.versions = AdapterVersions(bank, config.lora_base_dir, keep=config.lora_resident_versions,
                                            from_store=config.lora_base_from_store)
        return bank

    @property
    def lora(self):
        """The resident LoRA adapters (None without --enable-lora)."""
        return self.scheduler.lora

    def _adapter(self, item: GenerateItem):
        if item.lora_path is None:  # the served adapter of a run's adapter versions, else the base
            return self.lora.acquire(None) if self.lora is not None else None
        if self.lora is None:
            raise InvalidInput("lora_path needs an engine started with --enable-lora")
        return self.lora.acquire(item.lora_path)

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
        """Tokenize and validate every item first: a bad item rejects the whole request.

        A ``rid`` already in flight is refused (400, as SGLang does): ``/abort_request`` must
        name exactly one request. The rid is released when its sequence finishes."""
        if self.scheduler.dead:
            raise EngineUnrecoverable(self.scheduler.dead)
        self.memory.check_can_generate()
        prompts = [self._prompt_ids(item) for item in request.items]
        for item, prompt in zip(request.items, prompts):
            self._check_routed_experts(item, len(prompt))
            check_logprob_start_len(item, len(prompt))
            check_reported_logprobs(item, len(prompt), self.runner.vocab_size)
        self._claim_rids([item.rid for item in request.items])
        adapters: list = []
        try:
            adapters.extend(self._adapter(item) for item in request.items)
        except BaseException:
            for adapter in adapters:
                if adapter is not None:
                    self.lora.release(adapter)
            for item in request.items:
                self._release_rid(item.rid)
            raise
        return [
            Sequence(
                item=item, prompt_ids=prompt, generator=self.scheduler.new_generator(item.sampling.sampling_seed),
                sink=_ReleasingSink(make_sink(item), self._release), stop_ids=self.stop_ids, adapter=adapter,
            )
            for item, prompt, adapter in zip(request.items, prompts, adapters)
        ]

    def _claim_rids(self, rids: list[str]) -> None:
        with self._rid_lock:
            taken = [rid for rid in rids if rid in self._live_rids]
            if taken:
                raise InvalidInput(f"duplicate request id(s) already in flight: {taken[:3]}")
            self._live_rids.update(rids)

    def _release_rid(self, rid: str) -> None:
        with self._rid_lock:
            self._live_rids.discard(rid)

    def _release(self, seq: Sequence) -> None:
        self._release_rid(seq.rid)
        if seq.adapter is not None:
            self.lora.release(seq.adapter)

    def submit(self, seq: Sequence) -> None:
        if seq.item.sampling.max_new_tokens == 0 and not seq.item.wants_input_logprobs:  # scoring needs a prefill
            seq.version_start = seq.version_end = self.version
            seq.finish = FinishReason("length", {"length": 0})  # SGLang answers at once too
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
            if len(item.text) > self.max_prompt_chars:  # bounded before tokenizing: no 50 MB encode
                raise InvalidInput(f"text prompt of {len(item.text)} characters cannot fit the model's context length "
                                   f"{self.runner.max_context} (more than {self.max_prompt_chars} characters)")
            ids = self.tokenizer.encode(item.text)  # SGLang: the tokenizer's default special tokens
        if not ids:
            raise InvalidInput("the prompt is empty")
        total = len(ids) + item.sampling.max_new_tokens
        if total > self.runner.max_context:
            raise InvalidInput(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({item.sampling.max_new_tokens}) = {total} "
                f"exceeds the model's context length {self.runner.max_context}"
            )
        return ids

    def _check_routed_experts(self, item: GenerateItem, prompt_len: int) -> None:
        if not item.return_routed_experts:
            return
        if not self.config.enable_return_routed_experts:
            raise InvalidInput("return_routed_experts needs the server started with --enable-return-routed-experts")
        if item.sampling.max_new_tokens == 0:
            raise InvalidInput("return_routed_experts with max_new_tokens=0 is not supported by the built-in engine "
                               "(it answers such requests without a forward pass)")
        if not 0 <= item.routed_experts_start_len <= prompt_len:
            raise InvalidInput(f"routed_experts_start_len must be in [0, {prompt_len}] (the prompt's length), "
                               f"got {item.routed_experts_start_len}")

    def _eos_ids(self) -> set[int]:
        ids = self.runner.eos_token_ids()
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
        return result_json(seq, self.tokenizer)

    # ------------------------------------------------------------------ pause / abort

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
        return self.scheduler.call(lambda s: s.flush()).result()

    # ------------------------------------------------------------------ colocation (engines/builtin/memory.py)

    def release_memory(self, tags: list[str] | None) -> dict:
        def release(s: Scheduler) -> list[str]:
            released = self.memory.release(self.runner, tags, busy=bool(s.running) or s.num_waiting > 0)
            s.prefix_cache.drop()  # its KV goes with the memory (and with weights that are no more)
            return released

        released = self.scheduler.call(release).result()
        return {"success": True, "message": f"released {tags or 'all'}", "released": released}

    def resume_memory(self, tags: list[str] | None) -> dict:
        released = self.scheduler.call(lambda s: self.memory.resume(self.runner, tags)).result()
        return {"success": True, "message": f"resumed {tags or 'all'}", "released": released}

    # ------------------------------------------------------------------ info

    def model_info(self) -> dict:
        return {
            "model_path": str(self.config.model_path),
            "tokenizer_path": str(self.config.model_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.version,
            **resident_versions(self.lora),
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.runner.config_json.get("model_type"),
            "architectures": list(self.runner.config_json.get("architectures") or []),
            "quantization": self.runner.quantization,
            "quantization_config": self.runner.config_json.get("quantization_config"),
        }

    def weight_checksums(self, algorithm: str) -> dict:
        """Checksums of the live weights' bytes by HF name (``--check-weight-update-equal``).

        The tensor references are taken on the scheduler thread, so they are of one version
        (an activation replaces tensors, it never writes into them); hashing runs off it."""
        from miles_disagg.weights.checksums import CHECKSUMS, checksum
        from miles_disagg.weights.torch_bytes import tensor_bytes

        if algorithm not in CHECKSUMS:
            raise InvalidInput(f"unknown checksum {algorithm!r} (known: {', '.join(CHECKSUMS)})")
        if self.lora is not None and self.lora.versions is not None:  # the run's weights are its adapter versions
            return self.lora.served_checksums(algorithm)
        version, tensors = self.scheduler.call(
            lambda s: (s.version, {name: t.data for name, t in self.runner.named_weights().items()})).result()
        return {"weight_version": version, "algorithm": algorithm, "source": "live",
                "checksums": {name: checksum(algorithm, tensor_bytes(t.detach().cpu())) for name, t in tensors.items()}}

    def health(self) -> str | None:
        """None when serving; else why not (the scheduler died, or its last step failed)."""
        s = self.scheduler
        if s.dead or not s.alive:
            return s.dead or "engine scheduler thread is not running"
        return s.fault

    def server_info(self) -> dict:
        s = self.scheduler
        return {
            **_SINGLE_PROCESS_SERVER_ARGS,
            "model_path": str(self.config.model_path),
            "tokenizer_path": str(self.config.model_path),
            "host": self.config.host,
            "port": self.config.port,
            "device": self.config.device,
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "quantization": self.runner.quantization,  # SGLang's server arg (None: unquantized)
            "max_running_requests": self.config.max_running_requests,
            "random_seed": self.config.random_seed,
            "enable_return_routed_experts": self.config.enable_return_routed_experts,  # SGLang's server arg
            "enable_lora": self.config.enable_lora,  # SGLang's server args, and the adapters resident
            "max_loaded_loras": self.config.max_loaded_loras, "max_lora_rank": self.config.max_lora_rank,
            "loaded_lora_adapters": self.lora.describe() if self.lora is not None else [],
            # a run's adapter chain (--lora-base-dir): what a job attaching this engine checks it serves
            "lora_base_dir": str(self.config.lora_base_dir) if self.config.lora_base_dir else None,
            "lora_base_from_store": self.config.lora_base_from_store,  # version 0 from the weight store
            "context_length": self.runner.max_context,
            "max_req_input_len": self.runner.max_context - 1,
            "weight_version": self.version,
            **resident_versions(self.lora),
            "version": ENGINE_VERSION,
            "miles_disagg": ANNOUNCEMENT,
            # this engine's roots: a job attaching it must pull from one of these and into this
            "weight_store_dirs": [str(d) for d in self.updates.roots.store_dirs],
            "region": self.config.region,
            "local_checkpoint_dir": str(self.updates.roots.local_dir) if self.updates.roots.local_dir else None,
            "internal_states": [{
                "paused_mode": s.paused_mode,
                "num_running_requests": len(s.running),
                "num_waiting_requests": s.num_waiting,
                "num_steps": s.num_steps,
                "num_aborted_requests": s.num_aborted,
                "num_faults": s.num_faults,
                "fault": s.fault or s.dead,
                "staged_version": self.updates.stager.staged_version(),
                "memory_released": sorted(self.memory.released),
                "weights_path": str(self.updates.weights_path),
                "prefix_cache": s.prefix_cache.to_json(),
            }],
        }


REQUEST_BATCHES = 4  # one /generate may carry this many full running sets of prompts
PROMPT_CHARS_SAFETY = 2  # normalization may shorten text a little; stay far on the safe side


def _max_prompt_chars(tokenizer, max_context: int) -> int:
    """Characters beyond which a text prompt certainly needs more tokens than the context holds:
    no token covers more characters than the longest vocabulary entry."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return PROMPT_CHARS_SAFETY * max_context * max(1, longest)
