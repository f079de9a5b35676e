"""Stored entries to Arrow record batches: the implementation is pigeon-client's
(:mod:`pigeon.client.arrow`, shared with the Arrow consumer API); the names the source
and its tests use are re-exported here."""

from __future__ import annotations

from pigeon.client.arrow import (
    DATA_COLUMN,
    MAX_BYTES,
    MAX_ROWS,
    PROPERTIES,
    SOURCE_COLUMNS,
    TIMESTAMP,
    Decode,
    EntryLike,
    arrow_schema,
    record_batches,
)

__all__ = [
    "DATA_COLUMN",
    "MAX_BYTES",
    "MAX_ROWS",
    "PROPERTIES",
    "SOURCE_COLUMNS",
    "TIMESTAMP",
    "Decode",
    "EntryLike",
    "arrow_schema",
    "record_batches",
]
