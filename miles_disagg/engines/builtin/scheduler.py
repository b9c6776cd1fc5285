"""Continuous batching on one background thread, with SGLang's pause modes.

Loop, one iteration per step::

    run queued commands (pause, continue, activation, abort) -> admit waiting requests
    (one batched prefill) -> one batched decode step -> finished requests leave

Requests join and leave only between steps, and every mutation of the running set,
the KV cache or the weights happens on this thread, so a step never sees a half-swapped
policy. Commands from other threads (:meth:`Scheduler.call`) run between steps, also
while paused; a command that raises fails only its own future.

Pause modes (``/pause_generation``), all of which hold new requests in the queue until
``/continue_generation``:

* ``abort``    - in-flight and queued requests finish now with ``finish_reason.type == "abort"``
  and the tokens generated so far.
* ``retract``  - in-flight requests drop their KV and go back to the head of the queue;
  after continue they are re-prefilled over prompt + tokens generated so far (with
  whatever weights are live then) and carry on.
* ``in_place`` - stepping stops; the KV cache is kept and decoding resumes on continue.

Faults: a step that raises fails the requests in the batch with ``finish_reason`` abort and
``status_code`` 500 (the HTTP layer answers them with 500) and sets :attr:`Scheduler.fault`
until a later step runs a forward pass cleanly; if the thread itself ever dies,
:attr:`Scheduler.dead` is set, every queued and in-flight request and command is failed
(503) and later ones fail at once. Both show in ``/health``: the engine never dies silently.

Prefix cache (:mod:`.prefix_cache`, through :mod:`.forward_passes`, which makes each step's model
calls): a joining request whose prompt continues a cached sequence
runs only its new tokens (:meth:`ModelRunner.extend`); a finishing one leaves its KV there unless
the weights changed since its prefill (:meth:`Scheduler.weights_changed` drops the cache at every
swap, so KV never crosses weights).

Versions: a request records the live weight version at its first forward pass
(``weight_version_start``) and at every sampled token (``weight_version_end``); they
differ exactly when an activation happened while it was in flight. A request's own state and rules
(:class:`~.sequence.Sequence`) are in :mod:`.sequence`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import traceback
from typing import Any, Callable

import torch

from miles_disagg.engines.builtin.forward_passes import ForwardPasses
from miles_disagg.engines.builtin.model_runner import KVBatch, ModelRunner
from miles_disagg.engines.builtin.prefix_cache import PrefixCache
from miles_disagg.engines.builtin.protocol import FinishReason
from miles_disagg.engines.builtin.sampling import make_generator
from miles_disagg.engines.builtin.sequence import Sequence, StopTextChecker, finish_reason
from miles_disagg.types import EngineUnrecoverable

log = logging.getLogger(__name__)


class Scheduler:
    """Owns the running batch; see the module docstring for the loop and pause contract."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        version: str,
        max_running: int,
        seed: int,
        stop_text: StopTextChecker,
        prefix_cache_tokens: int = 0,
        lora: Any = None,
    ):
        self.runner = runner
        self.lora = lora  # engines/builtin/lora.py's LoraBank with --enable-lora
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.passes = ForwardPasses(runner, self.prefix_cache, lora)
        self.weights_epoch = 0  # bumped by every swap of live tensors (weights_changed)
        self.version = version
        self.max_running = max_running
        self._stop_text = stop_text
        self._seed_rng = make_generator(seed)
        self._cond = threading.Condition()
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._commands: collections.deque[tuple[Callable, concurrent.futures.Future]] = collections.deque()
        self._stopping = False
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.kv: KVBatch | None = None
        self.paused_mode: str | None = None
        self.num_steps = 0
        self.num_aborted = 0
        self.num_faults = 0
        self.fault: str | None = None  # last step failure, cleared by the next clean forward pass
        self.dead: str | None = None  # why the scheduler thread stopped (None while it runs)
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    # ------------------------------------------------------------------ other threads

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def new_generator(self, seed: int | None) -> torch.Generator:
        if seed is None:
            with self._cond:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return make_generator(seed)

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence; it joins the batch at the next step boundary (unless paused)."""
        with self._cond:
            if not self._stopping:
                self._inbox.append(seq)
                self._cond.notify_all()
                return
        self._finish(seq, FinishReason.abort(self.dead or "engine is shutting down", 503, "ServiceUnavailable"))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def call(self, fn: Callable[["Scheduler"], Any]) -> concurrent.futures.Future:
        """Run ``fn(self)`` on the scheduler thread between two steps (also while paused)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                future.set_exception(EngineUnrecoverable(self.dead or "engine is shutting down"))
                return future
            self._commands.append((fn, future))
            self._cond.notify_all()
        return future

    @property
    def num_waiting(self) -> int:
        """Queued requests, including those submitted since the last step boundary."""
        return len(self.waiting) + len(self._inbox)

    # ------------------------------------------------------------------ commands (scheduler thread)

    def pause(self, mode: str) -> int:
        """Enter pause ``mode``; return how many requests were in flight."""
        self._drain_inbox()
        count = len(self.running) + len(self.waiting)
        if mode == "abort":
            self.abort_all("aborted by pause_generation(mode=abort)")
        elif mode == "retract":
            self._retract_all()
        self.paused_mode = mode
        return count

    def resume(self) -> None:
        self.paused_mode = None

    def abort_all(self, message: str, status_code: int | None = None, err_type: str | None = None) -> int:
        self._drain_inbox()
        victims = list(self.running) + list(self.waiting)
        self.running, self.kv = [], None
        self.waiting.clear()
        for seq in victims:
            self._finish(seq, FinishReason.abort(message, status_code, err_type))
        return len(victims)

    def abort(self, rid: str, message: str) -> bool:
        self._drain_inbox()
        for seq in list(self.waiting):
            if seq.rid == rid:
                self.waiting.remove(seq)
                self._finish(seq, FinishReason.abort(message))
                return True
        for row, seq in enumerate(self.running):
            if seq.rid == rid:
                keep = [i for i in range(len(self.running)) if i != row]
                self._keep_rows(keep)
                self._finish(seq, FinishReason.abort(message))
                return True
        return False

    def can_flush(self) -> bool:
        """SGLang's rule: flush only when idle. While paused, requests held or retracted hold no
        KV (SGLang keeps new requests out of its scheduler while paused), so only KV held in
        place blocks a flush then; unpaused, any running or queued request does."""
        self._drain_inbox()
        if self.paused_mode is not None:
            return not (self.paused_mode == "in_place" and self.running)
        return not self.running and not self.waiting

    @property
    def cache_key(self) -> tuple[str, int]:
        """What KV is valid for: the live version label and the weights epoch (a swap that keeps the
        label is other weights all the same)."""
        return self.version, self.weights_epoch

    def weights_changed(self) -> None:
        """On the scheduler thread, at every swap of live tensors: no KV computed before is reused
        (in-flight requests keep theirs per the pause mode, and it never joins the cache)."""
        self.weights_epoch += 1
        self.prefix_cache.drop()

    def flush(self) -> bool:
        """``/flush_cache``: when :meth:`can_flush`, empty the prefix cache; whether it did."""
        if not self.can_flush():
            return False
        self.prefix_cache.drop()
        return True

    def _retract_all(self) -> None:
        for seq in reversed(self.running):
            seq.num_retractions += 1
            self.waiting.appendleft(seq)
        self.running, self.kv = [], None

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # never die silently: record, then fail everyone below
            self.dead = f"engine scheduler thread died: {type(exc).__name__}: {exc}"
            log.critical("%s\n%s", self.dead, traceback.format_exc())
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        """Fail queued commands and requests; later ones fail at once (``_stopping``)."""
        with self._cond:
            self._stopping = True
        message = self.dead or "engine is shutting down"
        try:
            self.abort_all(message, 503, "ServiceUnavailable")
        finally:
            self._fail_commands()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._commands and not self._has_work():
                    self._cond.wait(timeout=1.0)
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for fn, future in commands:
                self._run_command(fn, future)
            if self.paused_mode is None:
                self._guarded_step()

    def _has_work(self) -> bool:
        return self.paused_mode is None and bool(self._inbox or self.waiting or self.running)

    def _run_command(self, fn: Callable, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(self))
        except BaseException as exc:  # the caller decides; the loop keeps serving
            future.set_exception(exc)

    def _fail_commands(self) -> None:
        with self._cond:
            for _, future in self._commands:
                if future.set_running_or_notify_cancel():
                    future.set_exception(EngineUnrecoverable(self.dead or "engine is shutting down"))
            self._commands.clear()

    def _guarded_step(self) -> None:
        try:
            self._drain_inbox()
            ran = self._admit()
            ran = self._decode() or ran
            self.num_steps += 1
        except Exception as exc:  # a real internal fault: fail the batch (500), keep the server up
            self.num_faults += 1
            self.fault = f"internal engine error: {type(exc).__name__}: {exc}"
            log.error("engine step failed:\n%s", traceback.format_exc())
            self.abort_all(self.fault, 500, "InternalServerError")
            return
        if ran:
            self.fault = None

    def _drain_inbox(self) -> None:
        with self._cond:
            while self._inbox:
                self.waiting.append(self._inbox.popleft())

    def _admit(self) -> bool:
        room = self.max_running - len(self.running)
        if room <= 0 or not self.waiting:
            return False
        joining = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        for seq in joining:
            if seq.version_start is None:
                seq.version_start = self._version_of(seq)
            seq.cache_key = self.cache_key
        hits = [self.passes.cached_prefix(seq, self.cache_key) for seq in joining]
        cold = [seq for seq, hit in zip(joining, hits) if hit is None]
        warm = [(seq, hit) for seq, hit in zip(joining, hits) if hit is not None]
        try:
            parts = ([self.passes.prefill(cold)] if cold else []) + [
                self.passes.extend(seq, past) for seq, past in warm]
        except Exception as exc:  # they are in neither queue now: answer them before re-raising
            message = f"internal engine error: {type(exc).__name__}: {exc}"
            for seq in joining:
                self._finish(seq, FinishReason.abort(message, 500, "InternalServerError"))
            raise
        joined = cold + [seq for seq, _ in warm]
        self.running.extend(joined)
        for _, kv in parts:
            self.kv = self.runner.merge(self.kv, kv)
        self._sample_rows(torch.cat([logits for logits, _ in parts]), first_row=len(self.running) - len(joined))
        return True

    def _version_of(self, seq: Sequence) -> str:
        """The weight version ``seq``'s tokens come from: its adapter's (a run's adapter version); under
        adapter versions a base row's stays the one it started with (the base never changes); else the engine's."""
        adapter = seq.adapter
        if adapter is not None and adapter.version is not None:
            return adapter.version
        if self.lora is not None and self.lora.versions is not None and seq.version_start is not None:
            return seq.version_start
        return self.version

    def _decode(self) -> bool:
        if not self.running:
            return False
        self._sample_rows(self.passes.decode(self.kv, self.running), first_row=0)
        return True

    def _sample_rows(self, logits: torch.Tensor, first_row: int) -> None:
        """Sample for rows ``first_row..`` of the running batch; finished rows leave."""
        logits = logits.cpu()
        finished: list[int] = []
        for offset in range(logits.shape[0]):
            row = first_row + offset
            seq = self.running[row]
            if seq.item.sampling.max_new_tokens == 0:  # a scoring call is done after its prefill
                seq.finish = FinishReason("length", {"length": 0})
                finished.append(row)
                continue
            token = seq.sample(logits[offset], self._version_of(seq))
            reason = finish_reason(seq, token, self._stop_text, self.runner.max_context)
            if reason is not None:
                seq.finish = reason
                finished.append(row)
            else:
                seq.sink.on_token(seq)
        if finished:
            for row in finished:
                self.passes.remember(self.running[row], self.kv, row, self.cache_key)
            done = [self.running[row] for row in finished]
            self._keep_rows([i for i in range(len(self.running)) if i not in set(finished)])
            for seq in done:
                self._finish(seq, seq.finish)

    def _keep_rows(self, keep: list[int]) -> None:
        self.kv = self.runner.select(self.kv, keep) if self.kv is not None else None
        self.running = [self.running[i] for i in keep]

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish = reason
        self.num_aborted += reason.type == "abort"
        if seq.version_start is None:
            seq.version_start = self.version
        if seq.version_end is None:
            seq.version_end = seq.version_start
        try:
            seq.sink.on_finish(seq)
        except Exception:  # a broken sink must not take the loop down
            log.error("result sink failed:\n%s", traceback.format_exc())
