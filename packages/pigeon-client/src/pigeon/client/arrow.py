"""Arrow record batches of stored entries: what the Arrow consumer API and connectors
(the Spark source) build, column by column, without Python work per message.

Importing this module needs pyarrow: ``pip install 'pigeon-client[arrow]'``. The
producer and consumer methods (``send_arrow``, ``receive_arrow``, ``read_arrow``,
``acknowledge_arrow``) live on the faces' Producer, Consumer and Reader; this module
holds the column definitions they share with connectors (see
:mod:`pigeon.client._arrow`).
"""

from __future__ import annotations

from pigeon.client._arrow import (
    DATA_COLUMN,
    MAX_BYTES,
    MAX_ROWS,
    PROPERTIES,
    RECEIVE_SCHEMA,
    SOURCE_COLUMNS,
    TIMESTAMP,
    Decode,
    EntryLike,
    arrow_schema,
    key_partitions,
    record_batches,
)

__all__ = [
    "DATA_COLUMN",
    "MAX_BYTES",
    "MAX_ROWS",
    "PROPERTIES",
    "RECEIVE_SCHEMA",
    "SOURCE_COLUMNS",
    "TIMESTAMP",
    "Decode",
    "EntryLike",
    "arrow_schema",
    "key_partitions",
    "record_batches",
]
