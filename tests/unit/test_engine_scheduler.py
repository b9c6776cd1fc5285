"""Batched KV surgery and the scheduler's pause modes, in process on the tiny Qwen3."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import pytest
import torch

from miles_disagg.engines.builtin.model_runner import ModelRunner
from miles_disagg.engines.builtin.protocol import GenerateItem, SamplingParams
from miles_disagg.engines.builtin.scheduler import Scheduler
from miles_disagg.engines.builtin.sequence import Sequence

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def runner(tiny_qwen3_dir):
    return ModelRunner(tiny_qwen3_dir)



@contextlib.contextmanager
def running_scheduler(runner, *, version: str, max_running: int = 8) -> Iterator[Scheduler]:
    """A started scheduler (seed 0, no stop strings), stopped on exit."""
    scheduler = Scheduler(runner, version=version, max_running=max_running, seed=0, stop_text=lambda seq: None)
    scheduler.start()
    try:
        yield scheduler
    finally:
        scheduler.stop()

def test_rows_joining_and_leaving_match_unbatched_forward(runner):
    seqs = [[5, 6, 7, 8, 9, 10], [20, 21]]
    logits, kv = runner.prefill(seqs)
    tokens = [int(row.argmax()) for row in logits]
    for step in range(4):
        for seq, token in zip(seqs, tokens):
            seq.append(token)
        if step == 1:  # a row joins
            new_logits, new_kv = runner.prefill([[30, 31, 32]])
            kv = runner.merge(kv, new_kv)
            seqs.append([30, 31, 32])
            tokens.append(int(new_logits[0].argmax()))
            seqs[-1].append(tokens[-1])
        if step == 2:  # the first row leaves
            kv, seqs, tokens = runner.select(kv, [1, 2]), seqs[1:], tokens[1:]
        logits = runner.decode(kv, [seq[-1] for seq in seqs])
        for row, seq in enumerate(seqs):
            expected = runner.full_logprobs(seq)[-1]
            assert torch.allclose(torch.log_softmax(logits[row], -1), expected, atol=1e-5)
        tokens = [int(row.argmax()) for row in logits]


class _Sink:
    def __init__(self):
        self.done = threading.Event()
        self.tokens = 0

    def on_token(self, seq):
        self.tokens += 1

    def on_finish(self, seq):
        self.done.set()


def _sequence(scheduler, rid, max_new=60):
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    item = GenerateItem(rid=rid, input_ids=(5, 6, 7), text=None, sampling=params, return_logprob=True)
    return Sequence(item=item, prompt_ids=[5, 6, 7], generator=scheduler.new_generator(0), sink=_Sink(),
                    stop_ids=frozenset())


def _run(scheduler, seq):
    scheduler.submit(seq)
    assert seq.sink.done.wait(60)
    return seq.output_ids


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_and_continue_do_not_change_greedy_output(runner, mode):
    with running_scheduler(runner, version="0") as scheduler:
        reference = _run(scheduler, _sequence(scheduler, "ref"))
        seq = _sequence(scheduler, "paused")
        scheduler.submit(seq)
        while len(seq.output_ids) < 5:
            threading.Event().wait(0.001)
        assert scheduler.call(lambda s: s.pause(mode)).result(10) == 1
        generated = len(seq.output_ids)
        scheduler.call(lambda s: None).result(10)  # commands still run while paused; steps do not
        assert len(seq.output_ids) == generated
        scheduler.call(lambda s: s.resume()).result(10)
        assert seq.sink.done.wait(60)
        assert seq.output_ids == reference
        assert (seq.num_retractions == 1) == (mode == "retract")


def test_pause_abort_finishes_in_flight_with_abort(runner):
    with running_scheduler(runner, version="0") as scheduler:
        seq = _sequence(scheduler, "victim", max_new=2000)
        scheduler.submit(seq)
        while not seq.output_ids:
            threading.Event().wait(0.001)
        scheduler.call(lambda s: s.pause("abort")).result(10)
        assert seq.sink.done.wait(10)
        assert seq.finish.type == "abort" and len(seq.output_ids) < 2000
        held = _sequence(scheduler, "held", max_new=3)
        scheduler.submit(held)
        assert not held.sink.done.wait(0.2)
        scheduler.call(lambda s: s.resume()).result(10)
        assert held.sink.done.wait(30) and held.finish.type == "length"


def test_flush_follows_sglang_idle_rule(runner):
    with running_scheduler(runner, version="0") as scheduler:
        assert scheduler.call(lambda s: s.can_flush()).result(10)
        seq = _sequence(scheduler, "busy", max_new=2000)
        scheduler.submit(seq)
        while not seq.output_ids:
            threading.Event().wait(0.001)
        assert not scheduler.call(lambda s: s.can_flush()).result(10)  # running, not paused
        scheduler.call(lambda s: s.pause("retract")).result(10)
        assert scheduler.call(lambda s: s.can_flush()).result(10)  # retracted: no KV held
        scheduler.call(lambda s: s.resume()).result(10)
        generated = len(seq.output_ids)
        while len(seq.output_ids) <= generated:  # re-admitted and decoding again
            threading.Event().wait(0.001)
        scheduler.call(lambda s: s.pause("in_place")).result(10)
        assert not scheduler.call(lambda s: s.can_flush()).result(10)  # KV held in place
        scheduler.call(lambda s: s.abort_all("done")).result(10)
        assert scheduler.call(lambda s: s.can_flush()).result(10)


def test_version_spans_follow_the_live_version(runner):
    with running_scheduler(runner, version="1") as scheduler:
        seq = _sequence(scheduler, "spans", max_new=40)
        scheduler.submit(seq)
        while len(seq.output_ids) < 3:
            threading.Event().wait(0.001)
        switched_at = scheduler.call(lambda s: (setattr(s, "version", "2"), len(seq.output_ids))[1]).result(10)
        assert seq.sink.done.wait(60)
        assert seq.version_spans == [["1", 0, switched_at], ["2", switched_at, 40]]
        assert (seq.version_start, seq.version_end) == ("1", "2")


class _Fatal(BaseException):
    pass


def test_a_dead_scheduler_fails_in_flight_queued_and_later_work(runner):
    scheduler = Scheduler(runner, version="0", max_running=1, seed=0, stop_text=lambda seq: None)
    scheduler.start()
    first, queued = _sequence(scheduler, "first", max_new=2000), _sequence(scheduler, "queued", max_new=5)
    scheduler.submit(first)
    scheduler.submit(queued)  # max_running=1: waits behind ``first``
    while not first.output_ids:
        threading.Event().wait(0.001)

    def die(_s):
        raise _Fatal("loop bug")

    scheduler._decode = lambda: die(None)  # the next step escapes the per-step guard
    assert first.sink.done.wait(30) and queued.sink.done.wait(30)
    for seq in (first, queued):
        assert seq.finish.type == "abort" and seq.finish.status_code == 503
    assert "loop bug" in scheduler.dead and not scheduler.alive
    later = _sequence(scheduler, "later")
    scheduler.submit(later)
    assert later.sink.done.is_set() and later.finish.status_code == 503
    with pytest.raises(Exception, match="loop bug"):
        scheduler.call(lambda s: None).result(5)


def test_a_batched_prefill_scores_each_rows_own_tokens(runner):
    """Rows of different lengths, left-padded in one prefill, each scored from its own start: the
    input logprobs of one unbatched pass (raw logits), the first entry None, the last logits unchanged."""
    from miles_disagg.engines.builtin.model_runner import InputScoring

    rows = [[5, 6, 7, 8, 9, 10], [20, 21], [30, 31, 32]]
    scoring = [InputScoring(0, top_k=3), None, InputScoring(1)]
    plain, _ = runner.prefill(rows)
    assert runner.last_input_scores is None
    logits, _ = runner.prefill(rows, scoring=scoring)
    assert torch.allclose(logits, plain, atol=1e-5)
    first, unscored, third = runner.last_input_scores
    assert unscored is None
    for tokens, scores, start in ((rows[0], first, 0), (rows[2], third, 1)):
        full = runner.full_logprobs(tokens)
        expected = [float(full[pos - 1, tokens[pos]]) for pos in range(start + 1, len(tokens))]
        assert scores.token_logprobs[0] is None and len(scores.token_logprobs) == len(tokens) - start
        assert scores.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert first.top_logprobs[0] is None and all(len(row) == 3 for row in first.top_logprobs[1:])
    assert third.top_logprobs is None


def test_scoring_calls_finish_after_their_prefill_and_keep_their_scores_across_a_retraction(runner):
    """``max_new_tokens`` 0 with ``logprob_start_len``: done after the prefill (``length`` 0, no token),
    beside a generating request in the same batch; a retracted request is scored once, not again."""
    with running_scheduler(runner, version="3") as scheduler:
        def scored(rid, max_new):
            params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
            item = GenerateItem(rid=rid, input_ids=(5, 6, 7), text=None, sampling=params, return_logprob=True,
                                logprob_start_len=0)
            return Sequence(item=item, prompt_ids=[5, 6, 7], generator=scheduler.new_generator(0), sink=_Sink(),
                            stop_ids=frozenset())

        generating, scoring = scored("gen", 60), scored("score", 0)
        scheduler.submit(generating)
        scheduler.submit(scoring)
        assert scoring.sink.done.wait(60)
        assert scoring.output_ids == [] and scoring.finish.to_json() == {"type": "length", "length": 0}
        assert scoring.version_start == scoring.version_end == "3"
        assert len(scoring.input_scores.token_logprobs) == 3
        while len(generating.output_ids) < 5:
            threading.Event().wait(0.001)
        before = generating.input_scores
        scheduler.call(lambda s: s.pause("retract")).result(10)
        scheduler.call(lambda s: s.resume()).result(10)
        assert generating.sink.done.wait(60) and generating.num_retractions == 1
        assert generating.input_scores is before and generating.input_scores == scoring.input_scores
