"""Kafka RecordBatch v2: reading a Produce request's batches, storing them unchanged
inside a native batch (``formatVersion`` 2), and serving stored entries to Kafka
consumers.

The front door checks each batch of a Produce request with :func:`split_record_batches`
and :func:`read_batch_info`, stores ``wrap_record_batch(...)`` behind the usual entry
header, and answers a Fetch with :func:`kafka_batch_of_entry` per stored entry. Native
consumers read Kafka-format entries with :func:`pigeon.core.batch.decode_batch` like any
other. The byte layout and the Kafka ↔ PigeonMQ field mapping are documented in
:mod:`pigeon.core._kafka_records`, the compression of the records section in
:mod:`pigeon.core._kafka_records_codecs`.
"""

from __future__ import annotations

from pigeon.core._batch import FORMAT_KAFKA
from pigeon.core._kafka_records import (
    BATCH_HEADER_SIZE,
    DEFAULT_MAX_RECORDS_SIZE,
    RecordBatchInfo,
    count_records,
    encode_record_batch,
    parse_records,
    patch_base_offset,
    read_batch_info,
    split_record_batches,
)
from pigeon.core._kafka_records_codecs import compress_records, decompress_records
from pigeon.core._kafka_records_convert import (
    kafka_batch_of_entry,
    kafka_batch_of_kept,
    wrap_record_batch,
)

__all__ = [
    "BATCH_HEADER_SIZE",
    "DEFAULT_MAX_RECORDS_SIZE",
    "FORMAT_KAFKA",
    "RecordBatchInfo",
    "compress_records",
    "count_records",
    "decompress_records",
    "encode_record_batch",
    "kafka_batch_of_entry",
    "kafka_batch_of_kept",
    "parse_records",
    "patch_base_offset",
    "read_batch_info",
    "split_record_batches",
    "wrap_record_batch",
]
