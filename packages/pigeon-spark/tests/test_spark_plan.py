"""Offset planning: resolution, proportional rate limits, minPartitions splits."""

from __future__ import annotations

import pytest

from pigeon.spark._options import EARLIEST, LATEST
from pigeon.spark._plan import OffsetRange, PartitionState, cap, rate_limit, resolve, split_ranges

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
