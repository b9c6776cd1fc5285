"""``RequestThreads`` (``miles_disagg/bench/loadgen.py``), the load the benchmarks and the router and
service tests put on servers: with ``once`` every thread sends exactly one request, even when
``stop()`` comes before a slow thread has sent its own (seen on a busy machine: 19 answers of 20)."""

from __future__ import annotations

import threading

import pytest

from miles_disagg.bench.loadgen import RequestThreads

pytestmark = pytest.mark.unit


def test_once_sends_one_request_per_thread_even_when_stopped_before_the_threads_sent_theirs():
    sent = []

    def one(http, worker: int, n: int):
        sent.append((worker, n))
        return (worker, n)

    threads = RequestThreads(8, one, once=True, timeout_s=30)
    answers = threads.stop()  # at once: threads started a moment ago have not all sent theirs yet
    assert sorted(answers) == sorted(sent) == [(w, 0) for w in range(8)]


def test_without_once_threads_send_until_stop_and_not_after():
    started = threading.Barrier(3)
    count = {"n": 0}
    lock = threading.Lock()

    def one(http, worker: int, n: int):
        if n == 0:
            started.wait(timeout=30)
        with lock:
            count["n"] += 1
        return None  # nothing kept

    threads = RequestThreads(2, one, timeout_s=30)
    started.wait(timeout=30)
    assert threads.stop() == []
    after_stop = count["n"]
    assert after_stop >= 2
    assert count["n"] == after_stop  # every thread has ended: nothing is sent after stop() returns
