"""Partition-level access for connectors (the Spark source and sink): deterministic
range reads with no durable state, the offsets a range can span, a topic's partitions,
and the key hash producers route keyed messages with.

* :func:`partition_offsets` — ``{partition topic: (earliest available, next offset)}``;
* :func:`offsets_for_timestamp` — per partition, the first offset published at or after
  a time;
* :func:`read_range` — a :class:`RangeReader` over the raw stored entries covering
  ``[start, end)`` (decode them with :mod:`pigeon.core.batch`);
* :func:`partition_topics` — the partition topics of a topic (itself if not partitioned);
* :func:`topic_schema` — one version of a topic's schema (the batch header's
  ``schema_version`` is the registry version + 1; 0 = none);
* :func:`key_hash` — the partition of a keyed message is ``key_hash(key) % partitions``,
  so a writer that picks partitions itself agrees with every producer.

Details (missing ranges, permits) are in :mod:`pigeon.client._range`.
"""

from __future__ import annotations

from pigeon.client._core import key_hash
from pigeon.client._range import (
    RangeReader,
    offsets_for_timestamp,
    partition_offsets,
    partition_topics,
    read_range,
    topic_schema,
)

__all__ = [
    "RangeReader",
    "key_hash",
    "offsets_for_timestamp",
    "partition_offsets",
    "partition_topics",
    "read_range",
    "topic_schema",
]
