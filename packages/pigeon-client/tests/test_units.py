"""``pigeon.client._units``: the CLI's one way of writing counts, sizes, rates and
durations (the dashboard's ``units.js`` is held to it by the broker's tests)."""

from __future__ import annotations

import pytest

from pigeon.client import _units as units


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0 s"),
        (45, "45 s"),
        (90, "1 min 30 s"),
        (3600, "1 h"),
        (5400, "1 h 30 min"),
        (86400.0, "1 d"),
        (90000, "1 d 1 h"),
        (1.5, "1.5 s"),
        (0.25, "250 ms"),
        (-1, "-1"),
    ],
)
def test_durations(seconds: float, text: str) -> None:
    assert units.duration(seconds) == text


@pytest.mark.parametrize(
    ("size", "text"),
    [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (16_920_763.2, "16.9 MB"), (-1, "-1")],
)
def test_sizes(size: float, text: str) -> None:
    assert units.size(size) == text


def test_plurals_and_rates() -> None:
    assert [units.plural(n, "message") for n in (0, 1, 2, 12345)] == [
        "0 messages",
        "1 message",
        "2 messages",
        "12,345 messages",
    ]
    assert units.rate(16_920_763.2) == "16.9 MB/s"


def test_fields_by_name() -> None:
    assert units.field("message_ttl_s", 86400.0) == "1 d"
    assert units.field("backlog_quota_bytes", 1_000_000) == "1.0 MB"
    assert units.field("write_bytes_per_s", 16_920_763.2) == "16.9 MB/s"
    assert units.field("msg_rate_in", 1234.56) == "1,234.6 msg/s"
    assert units.field("mark_delete_offset", 123456) == "123456"  # an id, not an amount
    assert units.field("backlog", 86400) == "86,400"
    assert units.field("deduplication", True) == "True"
    assert units.field("ensemble_size", None) == "-"
