"""A version's objects are pulled side by side; one failure fails the pull, after the others end."""

import threading

import pytest

from miles_disagg.types import ChecksumMismatch
from miles_disagg.weights.object_pulls import OBJECTS_IN_FLIGHT, pull_all


def test_objects_are_pulled_side_by_side_up_to_the_bound():
    barrier = threading.Barrier(OBJECTS_IN_FLIGHT, timeout=30)
    done = []

    def pull(i):
        barrier.wait()  # only passes when OBJECTS_IN_FLIGHT pulls run at once
        done.append(i)

    pull_all([lambda i=i: pull(i) for i in range(2 * OBJECTS_IN_FLIGHT)])
    assert sorted(done) == list(range(2 * OBJECTS_IN_FLIGHT))


def test_one_failed_object_fails_the_pull_once_the_others_have_ended():
    ended = []

    def good(i):
        ended.append(i)

    def bad():
        raise ChecksumMismatch("model-1.safetensors", "aa", "bb", "xxh3-128")

    pulls = [lambda: good(0), bad, lambda: good(2), lambda: good(3), lambda: good(4)]
    with pytest.raises(ChecksumMismatch, match="model-1"):
        pull_all(pulls)
    assert sorted(ended) == [0, 2, 3, 4]


def test_one_object_is_pulled_in_the_calling_thread():
    seen = []
    pull_all([lambda: seen.append(threading.current_thread())])
    assert seen == [threading.current_thread()]
