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
  ``recapture_cuda_graph``, ``token_step``, ``flush_cache`` (there is no prefix cache to flush).
* ``return_routed_experts`` (with ``--enable-return-routed-experts``, mixture-of-experts models) is
  refused with ``max_new_tokens=0``: such requests are answered without a forward pass.
* Versions are strings as in SGLang (ints are accepted and reported as decimal strings);
  the start-up default is ``"0"`` (this project's base version), not SGLang's ``"default"``.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from miles_disagg.engines.builtin.config import EngineConfig
from miles_disagg.engines.builtin.dist_update import DistUpdater
from miles_disagg.engines.builtin.memory import WEIGHTS, MemoryReleased, MemoryState
from miles_disagg.engines.builtin.model_runner import ModelRunner
from miles_disagg.engines.builtin.protocol import (
    DistributedUpdate, FinishReason, GenerateItem, GenerateRequest, InitGroup, PullWeights, UpdateFromDisk,
    UpdateFromTensor,
)
from miles_disagg.engines.builtin.response import result_json
from miles_disagg.engines.builtin.scheduler import Scheduler, Sequence, Sink
from miles_disagg.engines.builtin.staging import Stager, version_ref_from_string
from miles_disagg.types import ConfigError, EngineUnrecoverable, Forbidden, InvalidInput, VersionRef
from miles_disagg.weights.hooks import PRE_READ_FLAG, load_hook

log = logging.getLogger(__name__)

ENGINE_VERSION = "miles-disagg-builtin-0.1.0"

# SGLang ``server_args`` keys a client may compare (miles checks an external engine's layout):
# this engine is one process on one device.
ANNOUNCEMENT = {"pull_weights": True, "delta_filters": ["byteplane", "none"], "weight_checksums": True}
"""What ``/get_server_info`` announces under ``miles_disagg``: this engine reads byte-plane
deltas (so a job may publish them) and serves ``/weight_checksums``."""

_SINGLE_PROCESS_SERVER_ARGS = {"tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0}


class _ReleasingSink:
    """Forwards to the HTTP sink and frees the request id when the sequence finishes."""

    def __init__(self, inner: Sink, release: Callable[[str], None]):
        self.inner, self.release = inner, release

    def on_token(self, seq: Sequence) -> None:
        self.inner.on_token(seq)

    def on_finish(self, seq: Sequence) -> None:
        self.release(seq.rid)
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
        )
        self.stager = Stager(self.runner, config.model_path, version_ref_from_string(config.weight_version),
                             pre_read_hook=load_hook(config.pull_weights_pre_read_hook, PRE_READ_FLAG))
        self.dist = DistUpdater(self.runner.device)
        self.memory = MemoryState()  # colocation: released tags (see engines/builtin/memory.py)
        self.weights_path = Path(config.model_path)
        self.roots = config.roots()
        self.max_prompt_chars = _max_prompt_chars(self.tokenizer, self.runner.max_context)
        # a batch may queue beyond the running set; past this many prompt tokens a request is refused unparsed
        self.max_request_tokens = REQUEST_BATCHES * config.max_running_requests * self.runner.max_context
        self._rid_lock = threading.Lock()
        self._live_rids: set[str] = set()

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
        self._claim_rids([item.rid for item in request.items])
        return [
            Sequence(
                item=item, prompt_ids=prompt, generator=self.scheduler.new_generator(item.sampling.sampling_seed),
                sink=_ReleasingSink(make_sink(item), self._release_rid), stop_ids=self.stop_ids,
            )
            for item, prompt in zip(request.items, prompts)
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

    def submit(self, seq: Sequence) -> None:
        if seq.item.sampling.max_new_tokens == 0:
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
        """``/update_weight_version``: only the label the live weights verifiably hold (a no-op),
        unless ``--allow-unverified-versions``; ``Forbidden`` otherwise, nothing changed."""
        if not self.config.allow_unverified_versions:
            live = self.stager.live_ref
            if live is None or version != str(live.version):
                held = f"verified version {live.version}" if live else "of no verified version"
                raise Forbidden(f"relabelling the live weights ({held}) as {version!r} without loading them is "
                                "refused: version labels come only from verified weights; pull and activate the "
                                "version with /pull_weights + /update_weights_from_disk")

        def apply(s: Scheduler) -> None:
            if abort_all:
                s.abort_all("aborted by update_weight_version")
            s.version = version  # a label only: the stager keeps tracking what the weights are

        self.scheduler.call(apply).result()

    # ------------------------------------------------------------------ weight updates

    def update_from_disk(self, req: UpdateFromDisk) -> dict:
        """Activate the staged version named ``weight_version`` if there is one, else reload
        ``model_path`` from disk (read and checked in the pause, before anything is swapped).

        Everything runs on the scheduler thread, so the staged version is taken, checked
        against the live weights and swapped in with no other activation in between."""
        how: list[str] = []

        def activate(s: Scheduler) -> dict:
            start = time.perf_counter()
            tensors, live_ref, path, kind = self._weights_for(req)
            how.append(kind)
            num_paused = len(s.running) + len(s.waiting) if s.paused_mode else 0
            if req.abort_all_requests:
                s.abort_all("aborted by update_weights_from_disk(abort_all_requests=true)")
            self._check_weights_resident()
            self.runner.swap_in(tensors)
            self.memory.loaded(self.runner.live_names(tensors))
            self.weights_path = path
            self.stager.set_live(live_ref)
            label = req.weight_version if req.weight_version is not None else _label_of(live_ref)
            if label is not None:
                s.version = label
            return {"num_paused_requests": num_paused, "pause_ms": round((time.perf_counter() - start) * 1e3, 3)}

        result = self.scheduler.call(activate).result()
        log.info("activated weights (%s) version=%s pause=%.1f ms", how[0], self.version, result["pause_ms"])
        return {
            "success": True,
            "message": f"Succeeded to update model weights ({how[0]} activation, pause {result['pause_ms']:.1f} ms).",
            "num_paused_requests": result["num_paused_requests"],
            "weight_version": self.version,
            "activation": how[0],
            "pause_ms": result["pause_ms"],
        }

    def _weights_for(self, req: UpdateFromDisk) -> tuple[dict, VersionRef | None, Path, str]:
        """``(tensors, published version they are or None, path, "staged"|"disk")``; nothing live changes.

        The live weights' version (what a staged delta must apply onto) comes only from
        where the tensors came from: the staged version, the base (version 0), or the version
        the local checkpoint's last verified pull recorded; a version *label* never vouches for
        the weights. A path outside the roots is ``OutsideRoots`` (403)."""
        staged = self.stager.take(req.weight_version)
        if staged is not None:
            return staged.tensors, staged.ref, staged.path, "staged"
        kind = self.roots.loadable(req.model_path)
        if kind == "base":
            path, held = self.roots.base_dir, VersionRef("", 0)
        else:
            path, held = self._held_local()
        self._check_label(req.weight_version, held, path)
        self.runner.check_compatible(path)
        return self.runner.load_tensors(path), held, path, "disk"

    def _held_local(self) -> tuple[Path, VersionRef]:
        """The local checkpoint's held slot and version (``Forbidden`` when it holds none)."""
        from miles_disagg.weights.materializer import Materializer

        view = Materializer(self.roots.local_dir, base_dir=self.config.model_path)
        held, path = view.held(), view.held_path()
        if held is None or path is None:
            raise Forbidden(f"the local checkpoint {str(self.roots.local_dir)!r} holds no verified version yet; "
                            "POST /pull_weights first")
        return path, held

    def _check_label(self, wanted: str | None, held: VersionRef, path: Path) -> None:
        if wanted is None or wanted == str(held.version) or self.config.allow_unverified_versions:
            return
        raise Forbidden(f"model_path {str(path)!r} holds verified version {held.version}, not weight_version "
                        f"{wanted!r}; version labels come only from verified weights (pull {wanted} first)")

    def pull_weights(self, req: PullWeights) -> dict:
        """Materialize + verify + stage (blocking, off the scheduler thread); only from a
        ``--weight-store-dir`` into ``--local-checkpoint-dir`` (``OutsideRoots`` otherwise)."""
        source, local = self.roots.source(req.source_dir), self.roots.local(req.local_checkpoint_dir)
        try:
            staged = self.stager.pull(source, req.target_version, local)
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

    def destroy_weights_update_group(self, group_name: str) -> dict:
        self.dist.destroy_group(group_name)
        return {"success": True, "message": f"Succeeded to destroy group {group_name!r}."}

    def update_from_distributed(self, req: DistributedUpdate) -> dict:
        tensors = self.dist.receive(req, self.runner.named_weights())

        def activate(s: Scheduler) -> float:
            start = time.perf_counter()
            if req.abort_all_requests:
                s.abort_all("aborted by update_weights_from_distributed(abort_all_requests=true)")
            self._check_weights_resident()
            self.runner.swap_in(tensors)
            self.memory.loaded(self.runner.live_names(tensors))
            if req.weight_version is not None:
                s.version = req.weight_version
            self.stager.set_live(None)  # broadcast weights are of no published version we can vouch for
            return (time.perf_counter() - start) * 1e3

        pause_ms = self.scheduler.call(activate).result()
        return {"success": True, "message": "Succeeded to update parameter online.", "pause_ms": round(pause_ms, 3)}

    # ------------------------------------------------------------------ colocation (engines/builtin/memory.py)

    def release_memory(self, tags: list[str] | None) -> dict:
        released = self.scheduler.call(
            lambda s: self.memory.release(self.runner, tags, busy=bool(s.running) or s.num_waiting > 0)).result()
        return {"success": True, "message": f"released {tags or 'all'}", "released": released}

    def resume_memory(self, tags: list[str] | None) -> dict:
        released = self.scheduler.call(lambda s: self.memory.resume(self.runner, tags)).result()
        return {"success": True, "message": f"resumed {tags or 'all'}", "released": released}

    def update_from_tensor(self, req: UpdateFromTensor) -> dict:
        """Copy the named tensors the caller shares (CUDA IPC / shared memory) into the live weights."""
        from miles_disagg.engines.tensor_transfer import deserialize_named_tensors

        tensors, weights = {}, self.runner.named_weights()
        for name, tensor in deserialize_named_tensors(req.serialized_named_tensors[0]):
            tensors[name] = self._converted_copy(name, tensor, weights)

        def activate(s: Scheduler) -> None:
            if req.abort_all_requests:
                s.abort_all("aborted by update_weights_from_tensor(abort_all_requests=true)")
            self._check_weights_resident()
            self.runner.swap_in(tensors)
            self.memory.loaded(self.runner.live_names(tensors))
            self.stager.set_live(None)  # weights handed over in memory are of no published version
            if req.weight_version is not None:
                s.version = req.weight_version

        self.scheduler.call(activate).result()
        return {"success": True, "message": f"Succeeded to update {len(tensors)} tensors."}

    def _converted_copy(self, name: str, tensor, weights: dict):
        from miles_disagg.types import LayoutMismatch

        live = weights.get(name)
        if live is None:
            raise LayoutMismatch(f"tensor {name!r} is not a parameter of the live model")
        shape = self.memory.layouts[name].shape if name in self.memory.layouts else tuple(live.shape)
        if tuple(tensor.shape) != shape:
            raise LayoutMismatch(f"tensor {name!r} has shape {tuple(tensor.shape)}, the live model {shape}")
        return tensor.to(device=self.runner.device, dtype=live.dtype, copy=True).contiguous()

    def _check_weights_resident(self) -> None:
        if WEIGHTS in self.memory.released:
            raise MemoryReleased("the weights are released; POST /resume_memory_occupation with tags "
                                 "[\"weights\"] before loading weights")

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
            "model_type": self.runner.config_json.get("model_type"),
            "architectures": list(self.runner.config_json.get("architectures") or []),
        }

    def weight_checksums(self, algorithm: str) -> dict:
        """Checksums of the live weights' bytes by HF name (``--check-weight-update-equal``).

        The tensor references are taken on the scheduler thread, so they are of one version
        (an activation replaces tensors, it never writes into them); hashing runs off it."""
        from miles_disagg.weights.checksums import CHECKSUMS, checksum
        from miles_disagg.weights.torch_bytes import tensor_bytes

        if algorithm not in CHECKSUMS:
            raise InvalidInput(f"unknown checksum {algorithm!r} (known: {', '.join(CHECKSUMS)})")
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
            "max_running_requests": self.config.max_running_requests,
            "random_seed": self.config.random_seed,
            "enable_return_routed_experts": self.config.enable_return_routed_experts,  # SGLang's server arg
            "context_length": self.runner.max_context,
            "max_req_input_len": self.runner.max_context - 1,
            "weight_version": self.version,
            "version": ENGINE_VERSION,
            "miles_disagg": ANNOUNCEMENT,
            # this engine's roots: a job attaching it must pull from one of these and into this
            "weight_store_dirs": [str(d) for d in self.roots.store_dirs],
            "local_checkpoint_dir": str(self.roots.local_dir) if self.roots.local_dir else None,
            "internal_states": [{
                "paused_mode": s.paused_mode,
                "num_running_requests": len(s.running),
                "num_waiting_requests": s.num_waiting,
                "num_steps": s.num_steps,
                "num_aborted_requests": s.num_aborted,
                "num_faults": s.num_faults,
                "fault": s.fault or s.dead,
                "staged_version": self.stager.staged_version(),
                "memory_released": sorted(self.memory.released),
                "weights_path": str(self.weights_path),
            }],
        }


def _label_of(ref: VersionRef | None) -> str | None:
    return None if ref is None else str(ref.version)


REQUEST_BATCHES = 4  # one /generate may carry this many full running sets of prompts
PROMPT_CHARS_SAFETY = 2  # normalization may shorten text a little; stay far on the safe side


def _max_prompt_chars(tokenizer, max_context: int) -> int:
    """Characters beyond which a text prompt certainly needs more tokens than the context holds:
    no token covers more characters than the longest vocabulary entry."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return PROMPT_CHARS_SAFETY * max_context * max(1, longest)
