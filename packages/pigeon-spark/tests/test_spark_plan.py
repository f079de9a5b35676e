"""Offset planning: resolution, proportional rate limits, minPartitions splits."""

from __future__ import annotations

import pytest

from pigeon.spark._options import EARLIEST, LATEST
from pigeon.spark._plan import (
    OffsetRange,
    PartitionState,
    by_timestamp,
    cap,
    rate_limit,
    resolve,
    split_ranges,
    trigger_due,
)

A, B = "persistent://public/default/t-partition-0", "persistent://public/default/t-partition-1"
STATES = {B: PartitionState(10, 50), A: PartitionState(0, 100)}


def test_resolve_symbolic_and_json() -> None:
    assert resolve("earliest", STATES, default="earliest", option="o") == {A: 0, B: 10}
    assert list(resolve("earliest", STATES, default="earliest", option="o")) == [A, B]  # sorted
    assert resolve("latest", STATES, default="earliest", option="o") == {A: 100, B: 50}
    assert resolve(None, STATES, default="latest", option="o") == {A: 100, B: 50}
    assert resolve({A: 7}, STATES, default="earliest", option="o") == {A: 7, B: 10}
    assert resolve({A: LATEST, B: EARLIEST}, STATES, default="latest", option="o") == {
        A: 100,
        B: 10,
    }
    # below the earliest stays as asked: the read reports the loss
    assert resolve({B: 0}, STATES, default="latest", option="o")[B] == 0
    assert resolve(None, STATES, default="earliest", option="o", at_time={B: 20, A: 30}) == {
        A: 30,
        B: 20,
    }


def test_resolve_rejects_unknown_partitions() -> None:
    with pytest.raises(ValueError, match="startingOffsets names partition"):
        resolve(
            {"persistent://public/default/x": 1},
            STATES,
            default="earliest",
            option="startingOffsets",
        )


def test_rate_limit_is_proportional_to_backlog() -> None:
    end = rate_limit({A: 0, B: 10}, {A: 300, B: 110}, 100)
    assert end == {A: 75, B: 35}  # backlogs 300 and 100 share 100 as 3:1
    assert sum(end[t] - s for t, s in {A: 0, B: 10}.items()) == 100
    # everything fits: no limit applies
    assert rate_limit({A: 0}, {A: 10}, 100) == {A: 10}
    # tiny shares still advance (ceil below 1), never past the latest offset
    assert rate_limit({A: 0, B: 0}, {A: 1000, B: 1}, 10) == {A: 9, B: 1}
    # a new partition (not in start) starts at 0
    assert rate_limit({A: 0}, {A: 10, B: 10}, 10) == {A: 5, B: 5}


def test_rate_limit_reads_exactly_the_limit() -> None:
    # three equal backlogs: each share is 6666.67; rounding every share down read 19,998
    parts = [f"persistent://public/default/t-partition-{i}" for i in range(3)]
    start = dict.fromkeys(parts, 0)
    end = rate_limit(start, dict.fromkeys(parts, 100_000), 20_000)
    assert sum(end.values()) == 20_000 and sorted(end.values()) == [6666, 6667, 6667]
    # many partitions, uneven backlogs, several rounds: always exactly the limit
    for limit in (1, 7, 20_000, 99_999):
        for n in (2, 5, 17):
            ps = [f"p{i}" for i in range(n)]
            begin = {p: i * 3 for i, p in enumerate(ps)}
            latest = {p: begin[p] + 1 + (i * 7919) % 50_000 for i, p in enumerate(ps)}
            backlog = sum(latest[p] - begin[p] for p in ps)
            got = rate_limit(begin, latest, limit)
            assert sum(got[p] - begin[p] for p in ps) == min(limit, backlog)
            assert all(begin[p] <= got[p] <= latest[p] for p in ps)
    # more partitions waiting than the limit: still no more than the limit
    assert sum(rate_limit(dict.fromkeys("abcd", 0), dict.fromkeys("abcd", 5), 2).values()) == 2


def test_min_offsets_per_trigger_waits_at_most_the_delay() -> None:
    assert trigger_due(0, 100, None, 1000)  # a run's first batch is due
    assert not trigger_due(99, 100, 10.0, 1000)
    assert trigger_due(100, 100, 10.0, 1000)
    assert trigger_due(1, 100, 1000.0, 1000)  # waited maxTriggerDelay


def test_starting_offsets_by_timestamp_names_the_read_partitions() -> None:
    plain = "persistent://public/default/plain"
    assert by_timestamp({A: 5, plain + "-partition-0": 6}, [A, B, plain], option="o") == {
        A: 5,
        plain: 6,
    }
    with pytest.raises(ValueError, match="o names partition"):
        by_timestamp({"persistent://public/default/x": 1}, [A], option="o")


def test_split_ranges_for_max_records_per_partition() -> None:
    ranges = [OffsetRange(A, 0, 25), OffsetRange(B, 10, 15)]
    assert split_ranges(ranges, None, 10) == [
        OffsetRange(A, 0, 9),
        OffsetRange(A, 9, 17),
        OffsetRange(A, 17, 25),
        OffsetRange(B, 10, 15),
    ]
    # minPartitions still applies when the pieces are fewer
    assert len(split_ranges([OffsetRange(A, 0, 100)], 4, 50)) == 4
    assert len(split_ranges([OffsetRange(A, 0, 100)], 2, 10)) == 10


def test_split_ranges_for_min_partitions() -> None:
    ranges = [OffsetRange(A, 0, 90), OffsetRange(B, 10, 40), OffsetRange("c", 5, 5)]
    assert split_ranges(ranges, None) == ranges[:2]
    split = split_ranges(ranges, 4)
    assert split == [
        OffsetRange(A, 0, 30),
        OffsetRange(A, 30, 60),
        OffsetRange(A, 60, 90),
        OffsetRange(B, 10, 40),
    ]
    assert split_ranges([OffsetRange(A, 0, 3)], 10) == [
        OffsetRange(A, 0, 1),
        OffsetRange(A, 1, 2),
        OffsetRange(A, 2, 3),
    ]
    assert split_ranges([OffsetRange(A, 0, 10), OffsetRange(B, 0, 10)], 2) == [
        OffsetRange(A, 0, 10),
        OffsetRange(B, 0, 10),
    ]


def test_cap_for_available_now() -> None:
    target = {A: 50, B: 20}
    assert cap({A: 80, B: 20}, {A: 10, B: 20}, target) == {A: 50, B: 20}
    assert cap({A: 30, B: 25, "new": 5}, {}, target) == {A: 30, B: 20}  # "new" came later
    assert cap({A: 60, "old": 7}, {A: 55, "old": 7}, target) == {A: 55, "old": 7}
