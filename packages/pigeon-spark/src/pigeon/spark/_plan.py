"""Offset arithmetic of the source: start/end resolution, rate limits, splits. No I/O.

Offsets are ``{partition topic: offset}`` dicts, where an offset is the partition's *next*
offset to read (Kafka's convention): a range ``[start, end)`` holds ``end - start``
messages. Offset dicts handed to Spark are sorted by name, because Spark compares the
serialised JSON of two offsets to tell whether new data arrived.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from pigeon.spark._options import EARLIEST, LATEST, OffsetSpec

__all__ = [
    "OffsetRange",
    "Offsets",
    "PartitionState",
    "cap",
    "rate_limit",
    "resolve",
    "sorted_offsets",
    "split_ranges",
]

Offsets = dict[str, int]


class PartitionState(NamedTuple):
    """What the broker says about one partition right now."""

    earliest: int  # first offset still stored
    latest: int  # next offset to be written


class OffsetRange(NamedTuple):
    """Offsets ``[start, end)`` of one partition, read by one Spark task."""

    topic: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return max(0, self.end - self.start)


def sorted_offsets(offsets: Mapping[str, int]) -> Offsets:
    return {k: int(offsets[k]) for k in sorted(offsets)}


def resolve(
    spec: OffsetSpec | None,
    states: Mapping[str, PartitionState],
    *,
    default: str,
    option: str,
    at_time: Mapping[str, int] | None = None,
) -> Offsets:
    """Concrete offsets of every partition from ``earliest``/``latest``/JSON/timestamp.

    Partitions missing from a JSON spec get ``default``; a JSON entry naming a partition
    that does not exist is an error.
    """
    if at_time is not None:
        return sorted_offsets(at_time)
    if spec is None:
        spec = "earliest" if default == "earliest" else "latest"
    if spec == "earliest":
        return sorted_offsets({t: s.earliest for t, s in states.items()})
    if spec == "latest":
        return sorted_offsets({t: s.latest for t, s in states.items()})
    unknown = sorted(set(spec) - set(states))
    if unknown:
        raise ValueError(
            f"{option} names partition(s) that are not part of the read: {', '.join(unknown)} "
            f"(partitions: {', '.join(sorted(states)) or 'none'})"
        )
    out: Offsets = {}
    for topic, state in states.items():
        value = spec.get(topic, EARLIEST if default == "earliest" else LATEST)
        if value == LATEST:
            value = state.latest
        elif value == EARLIEST:
            value = state.earliest
        out[topic] = value
    return sorted_offsets(out)


def rate_limit(start: Mapping[str, int], latest: Mapping[str, int], limit: int) -> Offsets:
    """End offsets reading at most ``limit`` messages, split across partitions in
    proportion to their backlog (Spark's Kafka source does the same)."""
    sizes = {t: max(0, latest[t] - start.get(t, 0)) for t in latest}
    total = sum(sizes.values())
    if total <= limit:
        return sorted_offsets(latest)
    out: Offsets = {}
    for topic, end in latest.items():
        begin = start.get(topic, 0)
        size = sizes[topic]
        if size == 0:
            out[topic] = start.get(topic, end)
            continue
        share = limit * size / total
        step = math.ceil(share) if share < 1 else math.floor(share)
        out[topic] = min(end, begin + step)
    return sorted_offsets(out)


def cap(latest: Mapping[str, int], start: Mapping[str, int], target: Mapping[str, int]) -> Offsets:
    """``latest`` held at ``target`` (Trigger.AvailableNow: nothing newer than what was
    there when the query started). Partitions that appeared since are left out; offsets
    never go below ``start``."""
    out: Offsets = {}
    for topic, offset in latest.items():
        if topic not in target and topic not in start:
            continue
        begin = start.get(topic, 0)
        out[topic] = max(begin, min(offset, target.get(topic, begin)))
    return sorted_offsets(out)


def split_ranges(ranges: list[OffsetRange], min_partitions: int | None) -> list[OffsetRange]:
    """Split large ranges so that there are about ``min_partitions`` of them, each
    range's share proportional to its size (Spark's Kafka ``minPartitions``)."""
    ranges = [r for r in ranges if r.end > r.start]
    if not min_partitions or len(ranges) >= min_partitions:
        return ranges
    total = sum(r.size for r in ranges)
    if total == 0:
        return ranges
    out: list[OffsetRange] = []
    for r in ranges:
        parts = min(r.size, max(1, round(r.size / total * min_partitions)))
        step, extra = divmod(r.size, parts)
        begin = r.start
        for i in range(parts):
            end = begin + step + (1 if i < extra else 0)
            out.append(OffsetRange(r.topic, begin, end))
            begin = end
    return out
