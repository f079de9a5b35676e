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
    assert units.field("deduplication", True) == "true"  # as set-policies takes it
    assert units.field("read_only", False) == "false"
    assert units.field("ensemble_size", None) == "-"


@pytest.mark.parametrize(
    ("column", "heading"),
    [
        ("free_disk_bytes", "FREE DISK"),
        ("disk_used_bytes", "DISK USED"),
        ("write_bytes_per_s", "WRITE RATE"),
        ("backlog_bytes", "BACKLOG SIZE"),
        ("msg_rate_in", "RATE IN"),
        ("msg_throughput_out", "THROUGHPUT OUT"),
        ("msgs_out", "MESSAGES OUT"),
        ("subscription_count", "SUBSCRIPTIONS"),
        ("storage_size", "STORAGE"),
        ("mark_delete_offset", "MARK DELETE OFFSET"),
        ("read_only", "READ-ONLY"),
        ("service_url", "SERVICE URL"),
        ("time", "TIME"),
    ],
)
def test_table_headings_are_words(column: str, heading: str) -> None:
    assert units.heading(column) == heading


def test_nested_values_are_inlined_as_words() -> None:
    assert units.field("cache", {"hits": 3, "misses": 0, "bytes": 1500}) == (
        "hits 3, misses 0, size 1.5 kB"
    )
    assert units.field("", {"latency_ms": 2, "ensemble_size": 1}) == "latency 2 ms, ensemble size 1"
    assert units.field("last_position", [4, 0]) == "4:0"
    assert units.field("acked_ranges", [[0, 5], [7, 8]]) == "0-4, 7"
    assert units.field("ensemble", ["b1:3181", "b2:3181"]) == "b1:3181, b2:3181"
    assert units.field("offload_deleting", []) == "-"
    assert units.field("read_only_reason", "") == "-"


def test_points_in_time_are_clock_times() -> None:
    text = units.field("time", 1_795_759_189_649)  # ms, as the throughput samples have it
    assert text.count(":") == 2 and "," not in text and text.startswith("2026-")
    assert units.field("reported_at", 1_795_759_189.6) == text  # seconds
    assert units.field("last_publish_time", 0) == "-"
