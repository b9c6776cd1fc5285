"""SGLang's serialized_named_tensors: handles round-trip; anything but tensor handles is refused."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch

from miles_disagg.engines.tensor_transfer import deserialize_named_tensors, serialize_named_tensors
from miles_disagg.types import InvalidInput


def test_named_tensors_round_trip_by_reference():
    sent = [("a.weight", torch.randn(4, 3)), ("b.bias", torch.arange(6, dtype=torch.bfloat16)[2:])]
    received = deserialize_named_tensors(serialize_named_tensors(sent))
    assert [name for name, _ in received] == ["a.weight", "b.bias"]
    for (_, want), (_, got) in zip(sent, received):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_payload_naming_another_global_is_refused():
    hostile = base64.b64encode(pickle.dumps([("x", os.system)])).decode()
    with pytest.raises(InvalidInput, match="posix.system|os.system|not a tensor handle"):
        deserialize_named_tensors(hostile)


@pytest.mark.parametrize("payload, message", [
    ("not base64!", "not base64"),
    (base64.b64encode(b"\x80\x04garbage").decode(), "cannot be opened"),
    (base64.b64encode(pickle.dumps({"x": 1})).decode(), "list of \\(name, tensor\\) pairs"),
])
def test_malformed_payloads_are_refused(payload, message):
    with pytest.raises(InvalidInput, match=message):
        deserialize_named_tensors(payload)
