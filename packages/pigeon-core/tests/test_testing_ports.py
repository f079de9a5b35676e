"""Test servers get ports the kernel never hands out on its own."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pigeon.core.testing import _process
from pigeon.core.testing._process import HOST, ephemeral_range, free_ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    low, _high = ephemeral_range()
    ports = free_ports(20)
    assert len(set(ports)) == 20
    assert all(_process.LOWEST_TEST_PORT <= p < low for p in ports)
    for port in ports:  # nothing listens there: each can be bound
        with socket.socket() as s:
            s.bind((HOST, port))


def test_a_port_in_use_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        port = taken.getsockname()[1]
        taken.listen()
        # the first random picks land on the taken port, then they are random again
        forced = iter([port] * 5)
        randint = _process._ports.randint
        monkeypatch.setattr(
            _process._ports, "randint", lambda a, b: next(forced, None) or randint(a, b)
        )
        monkeypatch.setattr(_process, "LOWEST_TEST_PORT", 1024)
        monkeypatch.setattr(_process, "ephemeral_range", lambda: (65000, 65535))
        assert free_ports(1)[0] != port


def test_unreadable_range_falls_back_to_linux_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(_process, "EPHEMERAL_RANGE_FILE", tmp_path / "absent")
    assert ephemeral_range() == (32768, 60999)
    (tmp_path / "garbage").write_text("not ports\n")
    monkeypatch.setattr(_process, "EPHEMERAL_RANGE_FILE", tmp_path / "garbage")
    assert ephemeral_range() == (32768, 60999)


def test_a_port_handed_out_lately_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # the first server has not bound its port yet: the next pick must not be that port
    first = free_ports(1)[0]
    forced = iter([first, first])
    randint = _process._ports.randint
    monkeypatch.setattr(
        _process._ports, "randint", lambda a, b: next(forced, None) or randint(a, b)
    )
    assert free_ports(1)[0] != first
    assert next(forced, None) is None  # both forced picks were tried and passed over
