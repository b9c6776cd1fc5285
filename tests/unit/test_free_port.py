"""``process.free_port``: a port for a server of ours, picked where outgoing connections never take
their source ports (below the kernel's ephemeral range), never one that is bound now."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from miles_disagg.net import process


def test_a_picked_port_is_below_the_ephemeral_range_and_bindable() -> None:
    low, _ = process.ephemeral_port_range()
    for _ in range(20):
        port = process.free_port()
        assert process.PICK_FLOOR <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_bound_port_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        free = next(port for port in range(29000, 30000) if process._can_bind("127.0.0.1", port))
        picks = iter([busy, busy, free])
        monkeypatch.setattr(process._pick, "choice", lambda candidates: next(picks))
        monkeypatch.setattr(process, "ephemeral_port_range", lambda: (32768, 60999))
        assert process.free_port() == free


def test_a_range_that_leaves_no_room_falls_back_to_the_kernels_pick(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    whole = tmp_path / "ip_local_port_range"
    whole.write_text("1024\t65535\n")
    monkeypatch.setattr(process, "LINUX_EPHEMERAL_RANGE", whole)
    assert process.ephemeral_port_range() == (1024, 65535)
    assert 1024 <= process.free_port() <= 65535


def test_the_range_is_read_from_the_kernel_or_assumed_from_32768(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "LINUX_EPHEMERAL_RANGE", tmp_path / "missing")
    assert process.ephemeral_port_range() == (32768, 65535)
