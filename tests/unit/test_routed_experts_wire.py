"""SGLang's routed-experts wire (``models/routed_experts_wire.py``): what the built-in engine encodes
the rollout decodes back, row for row, from the asked start position; a malformed payload is named."""

from __future__ import annotations

import base64
import pickle

import numpy as np
import pytest

from miles_disagg.models.routed_experts_wire import RoutingWireError, decode_routed_experts, encode_routed_experts

LAYERS, TOP_K = 3, 2


def routing(positions: int) -> np.ndarray:
    """Distinct experts per position and layer, -1 on the dense middle layer."""
    rows = np.arange(positions * LAYERS * TOP_K, dtype=np.int64).reshape(positions, LAYERS, TOP_K) % 97
    rows[:, 1] = -1
    return rows


@pytest.mark.parametrize("start_len", [0, 1, 4, 5])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, ">i4"])
def test_a_round_trip_gives_the_rows_from_start_len(start_len: int, dtype) -> None:
    rows = routing(5).astype(dtype)
    encoded = encode_routed_experts(rows, start_len)
    decoded = decode_routed_experts(encoded, LAYERS, TOP_K, rows=5 - start_len)
    assert decoded.dtype == np.int32 and decoded.shape == (5 - start_len, LAYERS, TOP_K)
    assert np.array_equal(decoded, rows[start_len:])
    assert np.array_equal(decode_routed_experts(encoded, LAYERS, TOP_K), decoded)  # rows from the size
    decoded[...] = 0  # a writable copy, not a view of the payload


def test_the_payload_is_little_endian_int32_in_c_order() -> None:
    rows = routing(2)
    assert base64.b64decode(encode_routed_experts(rows)) == rows.astype("<i4").tobytes()
    assert encode_routed_experts(np.zeros((0,), dtype=np.int32)) == ""  # nothing fed yet: an empty payload
    with pytest.raises(ValueError, match="routed_experts_start_len must be >= 0"):
        encode_routed_experts(rows, -1)


@pytest.mark.parametrize("payload, rows, fragment", [
    (None, 2, "must be a base64 string, got NoneType"),
    ([[1, 2]], 2, "must be a base64 string, got list"),
    ("%%%not base64", 2, "not valid base64"),
    (encode_routed_experts(routing(2))[:-4] + "\n" + encode_routed_experts(routing(2))[-4:], 2, "not valid base64"),
    (encode_routed_experts(routing(2)), 3, "holds 48 bytes; 3 positions x 3 layers x top-2 int32 need 72"),
    (encode_routed_experts(routing(2)) + "AAAA", None, "holds 51 bytes, not a whole number of rows"),
])
def test_a_malformed_payload_is_a_clear_error(payload, rows, fragment) -> None:
    with pytest.raises(RoutingWireError, match=fragment) as info:
        decode_routed_experts(payload, LAYERS, TOP_K, rows)
    assert "meta_info['routed_experts']" in str(info.value)
    again = pickle.loads(pickle.dumps(info.value))
    assert isinstance(again, ValueError) and str(again) == str(info.value)


def test_a_row_shape_without_layers_or_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="layers >= 1 and top-k >= 1"):
        decode_routed_experts("", 0, TOP_K)
