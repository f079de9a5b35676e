"""Offset arithmetic of the source: start/end resolution, rate limits, splits. No I/O.

Offsets are ``{partition topic: offset}`` dicts, where an offset is the partition's *next*
offset to read (Kafka's convention): a range ``[start, end)`` holds ``end - start``
messages. Offset dicts handed to Spark are sorted by name, because Spark compares the
serialised JSON of two offsets to tell whether new data arrived.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import NamedTuple

from pigeon.spark._options import EARLIEST, LATEST, OffsetSpec

__all__ = [
    "OffsetRange",
    "Offsets",
    "PartitionState",
    "by_timestamp",
    "cap",
    "rate_limit",
    "trigger_due",
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
    """End offsets reading exactly ``limit`` messages when more are waiting, split across
    partitions in proportion to their backlog, as Spark's Kafka source splits them.

    Every partition first gets the whole part of its share; the units left over (fewer
    than the partitions with a backlog) go one each to the partitions whose share is
    below one message (so that a small partition still advances), then to those with the
    largest fractions. Kafka's source rounds each share down instead and reads fewer
    (``maxOffsetsPerTrigger=20000`` over three equal partitions gave 19,998).
    """
    sizes = {t: max(0, latest[t] - start.get(t, 0)) for t in latest}
    total = sum(sizes.values())
    if total <= limit:
        return sorted_offsets(latest)
    # integer arithmetic: limit * size // total is exact however large the offsets
    take = {t: limit * size // total for t, size in sizes.items()}
    left = limit - sum(take.values())
    waiting = [t for t, size in sizes.items() if size > 0]
    waiting.sort(key=lambda t: (take[t] > 0, -(limit * sizes[t] % total), t))
    for topic in waiting[:left]:
        take[topic] += 1  # never past the latest: take < size as limit < total
    out: Offsets = {}
    for topic, end in latest.items():
        begin = start.get(topic, 0)
        out[topic] = min(end, begin + take[topic]) if sizes[topic] else start.get(topic, end)
    return sorted_offsets(out)


def trigger_due(
    new_messages: int, minimum: int, since_last_ms: float | None, delay_ms: int
) -> bool:
    """``minOffsetsPerTrigger``: run a micro-batch once ``minimum`` new messages wait, or
    once ``delay_ms`` (``maxTriggerDelay``) passed since the last one (``since_last_ms``
    None: no batch ran yet in this run, one is due), as Spark's Kafka source does."""
    if since_last_ms is None or new_messages >= minimum:
        return True
    return since_last_ms >= delay_ms


def by_timestamp(
    spec: Mapping[str, int], partitions: Collection[str], *, option: str
) -> dict[str, int]:
    """``startingOffsetsByTimestamp`` keyed by the read's partitions: partition 0 of a
    non-partitioned topic (Kafka's name for its only partition) is the topic itself; a
    partition that is not part of the read is an error (ValueError)."""
    out: dict[str, int] = {}
    unknown = []
    for topic, ms in spec.items():
        if topic not in partitions and topic.endswith("-partition-0"):
            plain = topic.removesuffix("-partition-0")
            if plain in partitions:
                topic = plain
        if topic not in partitions:
            unknown.append(topic)
        out[topic] = ms
    if unknown:
        raise ValueError(
            f"{option} names partition(s) that are not part of the read: "
            f"{', '.join(sorted(unknown))} (partitions: {', '.join(sorted(partitions)) or 'none'})"
        )
    return out


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


def split_ranges(
    ranges: list[OffsetRange],
    min_partitions: int | None,
    max_records: int | None = None,
) -> list[OffsetRange]:
    """Split large ranges: into pieces of at most ``max_records`` messages (Spark's Kafka
    ``maxRecordsPerPartition``), and, when that leaves fewer than ``min_partitions``
    pieces, so that there are about ``min_partitions`` of them, each range's share
    proportional to its size (Kafka's ``minPartitions``)."""
    ranges = [r for r in ranges if r.end > r.start]
    parts = {
        i: 1 if not max_records else math.ceil(r.size / max_records) for i, r in enumerate(ranges)
    }
    total = sum(r.size for r in ranges)
    if min_partitions and sum(parts.values()) < min_partitions and total:
        for i, r in enumerate(ranges):
            parts[i] = max(parts[i], min(r.size, round(r.size / total * min_partitions)))
    out: list[OffsetRange] = []
    for i, r in enumerate(ranges):
        step, extra = divmod(r.size, parts[i])
        begin = r.start
        for j in range(parts[i]):
            end = begin + step + (1 if j < extra else 0)
            out.append(OffsetRange(r.topic, begin, end))
            begin = end
    return out
