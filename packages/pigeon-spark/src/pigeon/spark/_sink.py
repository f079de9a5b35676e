"""Writing DataFrames to PigeonMQ: a batch sink (at-least-once) and a streaming sink
(exactly-once).

Input columns: ``value`` (binary or string, required), ``key`` (binary or string),
``topic`` (string; the ``topic`` option overrides it), ``properties``
(``map<string,string>``) and ``event_time`` (timestamp, or long ms since the epoch).
Other columns are ignored, so a DataFrame read from PigeonMQ can be written back as is:
read from a topic with a schema, ``value`` is a struct of the decoded record and
``data`` its bytes as stored, which are what is written then (``data`` is
required when ``value`` is a struct).

Exactly-once streaming writes rest on the broker's de-duplication, which stores each
``(producer name, sequence id)`` once and drops a sequence id at or below the highest it
stored for that producer:

* Every Spark task writes through its own producers, named
  ``spark-<query id>-<task partition>`` (the query id survives restarts: it is kept in
  the checkpoint), one producer per target topic partition.
* Message sequence ids are ``batch id * 2**32 + n`` where ``n`` counts the task's rows
  sent to that topic partition in this micro-batch. The rows of one Arrow batch for one
  partition are consecutive, so they go out as one ``send_arrow(..., sequence_id=first)``
  (entries built from the batch's buffers, no Python work per row).
* Rows are routed by a deterministic rule: keyed rows by the key's hash (as every
  PigeonMQ producer does), unkeyed rows in runs of 1000 unkeyed rows, round-robin from
  the task's partition number. How many rows of a task go to each topic partition thus
  depends only on the rows, not on their order.

A micro-batch that Spark runs again (after a crash or a restart) holds the same rows,
hence the same (producer, sequence id) ranges; what was already stored is skipped by the
writer (``producer.last_sequence_id``) or dropped by the broker. When a *task* failed
half-way and is retried, its rows must also come in the same order so that each sequence
id names the same row: true without a shuffle (``pigeon`` reads are pure range reads),
not guaranteed after one (Spark may fetch shuffle blocks in another order). For those
pipelines ``writeOrder=sorted`` sorts each task's rows by (topic, key, event time, value)
before numbering them, at the cost of holding the task's rows of one micro-batch in
memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    BinaryType,
    LongType,
    MapType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from pigeon.client import Client, Producer
from pigeon.client.arrow import key_partitions
from pigeon.client.ranges import partition_topics
from pigeon.core.errors import ProducerBusy
from pigeon.spark._clients import client_for
from pigeon.spark._options import OptionError, SinkOptions

__all__ = ["PigeonBatchWriter", "PigeonCommitMessage", "PigeonStreamWriter"]

log = logging.getLogger(__name__)

#: Unkeyed rows go to one partition in runs of this many rows (then the next partition).
UNKEYED_RUN = 1000
#: How long a task waits for a producer name held by an earlier attempt to be released.
PRODUCER_BUSY_WAIT = 60.0
SEQUENCE_SHIFT = 32

_ALLOWED: dict[str, tuple[type, ...]] = {
    "value": (BinaryType, StringType),
    "key": (BinaryType, StringType),
    "topic": (StringType,),
    "properties": (MapType,),
    "event_time": (TimestampType, TimestampNTZType, LongType),
}


@dataclass
class PigeonCommitMessage(WriterCommitMessage):
    rows: int
    skipped: int = 0  # exactly-once: rows an earlier attempt had already stored


def _check_input(schema: StructType, opts: SinkOptions) -> None:
    problems = []
    fields = {f.name: f.dataType for f in schema.fields}
    if isinstance(fields.get("value"), StructType):
        if isinstance(fields.get("data"), BinaryType):
            fields["value"] = fields["data"]  # a decoded schema topic: its bytes are written
        else:
            problems.append(
                "column 'value' is a struct (decoded from a schema topic): keep its 'data'"
                " column (the bytes) to write it, or read with decodeSchema=false"
            )
            del fields["value"]
    if "value" not in fields:
        problems.append("the DataFrame needs a 'value' column (binary or string)")
    for name, kinds in _ALLOWED.items():
        kind = fields.get(name)
        if kind is not None and not isinstance(kind, kinds):
            wanted = " or ".join(k.typeName() for k in kinds)  # type: ignore[attr-defined]
            problems.append(f"column {name!r} must be {wanted}, not {kind.simpleString()}")
    props = fields.get("properties")
    if isinstance(props, MapType) and not (
        isinstance(props.keyType, StringType) and isinstance(props.valueType, StringType)
    ):
        problems.append("column 'properties' must be map<string,string>")
    if opts.topic is None and "topic" not in fields:
        problems.append("set the 'topic' option or give the DataFrame a 'topic' column")
    if problems:
        raise OptionError(problems)


def _partition_of_rows(keys: pa.Array, partitions: int, task: int, unkeyed_before: int) -> pa.Array:
    """The target partition index (int32) of every row of one topic: a keyed row's
    ``crc32(key) % partitions`` (as every PigeonMQ producer routes), the i-th unkeyed row
    of the task (``unkeyed_before`` came in earlier record batches) partition
    ``(task + i // UNKEYED_RUN) % partitions``. Compute kernels, no loop per row."""
    unkeyed = pc.is_null(keys)
    run = pc.add(pc.subtract(pc.cumulative_sum(unkeyed.cast(pa.int64())), 1), unkeyed_before)
    slot = pc.add(pc.divide(run, UNKEYED_RUN), task)
    spread = pc.subtract(slot, pc.multiply(pc.divide(slot, partitions), partitions))
    if keys.null_count == len(keys):
        return spread.cast(pa.int32())
    return pc.if_else(unkeyed, spread.cast(pa.int32()), key_partitions(keys, partitions))


def _sorted(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """All rows, ordered by (topic, key, event time, value): the same rows in any order
    come out in one order."""
    collected = [rb for rb in batches if rb.num_rows]
    if not collected:
        return iter(())
    table = pa.Table.from_batches(collected)
    names = [n for n in ("topic", "key", "event_time", "value") if n in table.column_names]
    order = pc.sort_indices(table, sort_keys=[(n, "ascending") for n in names])
    return iter(table.take(order).combine_chunks().to_batches(max_chunksize=10_000))


def _open_producer(client: Client, topic: str, name: str) -> Producer:
    deadline = time.monotonic() + PRODUCER_BUSY_WAIT
    delay = 0.05
    while True:
        try:
            return client.create_producer(topic, producer_name=name, batching_max_delay_ms=20)
        except ProducerBusy:
            # An earlier attempt of this task still holds the name (its connection has not
            # closed yet): wait, then take over where it stopped.
            if time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(1.0, delay * 2)


class _Task:
    """What one write task sends; ``exactly_once`` = (query id, task partition, batch id)."""

    def __init__(self, opts: SinkOptions, exactly_once: tuple[str, int, int] | None) -> None:
        self.opts = opts
        self.client = client_for(opts.service_url, opts.security)
        self.exactly_once = exactly_once
        self.producers: dict[str, Producer] = {}
        self.partitions: dict[str, list[str]] = {}
        self.next_seq: dict[str, int] = {}
        self.futures: list[Future[Any]] = []
        self.rows = 0
        self.unkeyed: dict[str, int] = {}  # per target topic
        self.skipped = 0

    def _producer(self, topic: str) -> Producer:
        producer = self.producers.get(topic)
        if producer is None:
            if self.exactly_once is None:
                producer = self.client.create_producer(topic, batching_max_delay_ms=20)
            else:
                query_id, task, _batch = self.exactly_once
                producer = _open_producer(self.client, topic, f"spark-{query_id}-{task}")
            self.producers[topic] = producer
        return producer

    def write(
        self, batches: Iterator[pa.RecordBatch], *, sort: bool = False
    ) -> PigeonCommitMessage:
        try:
            if sort:
                batches = _sorted(batches)
            for rb in batches:
                self._write_batch(rb)
            for producer in self.producers.values():
                producer.flush()
            errors = [f.exception() for f in self.futures if f.exception() is not None]
            if errors:
                raise errors[0]  # type: ignore[misc]
        finally:
            for producer in self.producers.values():
                try:
                    producer.close()
                except Exception as exc:  # the task fails (or has failed) on its own
                    log.info("closing producer failed topic=%s error=%s", producer.topic, exc)
        return PigeonCommitMessage(self.rows, self.skipped)

    def _write_batch(self, rb: pa.RecordBatch) -> None:
        """Send one record batch with ``send_arrow``: the rows of each target topic (and,
        exactly-once, of each target partition) are gathered with ``filter`` and sent as
        one table; nothing is done per row in Python."""
        n = rb.num_rows
        if n == 0:
            return
        names = rb.schema.names

        def col(name: str) -> pa.Array | None:
            return rb.column(names.index(name)) if name in names else None

        value = col("value")
        if value is not None and pa.types.is_struct(value.type):
            value = col("data")  # decoded from a schema topic: write the stored bytes
        if value is None or value.null_count:
            raise ValueError("pigeon sink: 'value' must not be null")
        columns = {"value": value}
        for name in ("key", "properties", "event_time"):
            c = col(name)
            if c is not None and c.null_count < len(c):
                columns[name] = c
        rows = pa.RecordBatch.from_pydict(columns)
        if self.opts.topic is not None:
            groups = [(self.opts.topic, rows)]
        else:
            topic = col("topic")
            assert topic is not None  # _check_input
            if topic.null_count:
                raise ValueError("pigeon sink: 'topic' must not be null")
            groups = [(t, rows.filter(pc.equal(topic, t))) for t in pc.unique(topic).to_pylist()]
        self.rows += n
        for topic_name, part in groups:
            if self.exactly_once is None:
                self._send(self._producer(topic_name), part, None)
            else:
                self._write_exactly_once(topic_name, part)

    def _write_exactly_once(self, topic: str, rows: pa.RecordBatch) -> None:
        assert self.exactly_once is not None
        _query, task, batch_id = self.exactly_once
        base = batch_id << SEQUENCE_SHIFT
        parts = self.partitions.get(topic)
        if parts is None:
            parts = self.partitions[topic] = partition_topics(self.client, topic)
        if len(parts) == 1:
            split = [(parts[0], rows)]
        else:
            names = rows.schema.names
            keys = rows.column(names.index("key")) if "key" in names else pa.nulls(rows.num_rows)
            before = self.unkeyed.get(topic, 0)
            target = _partition_of_rows(keys.cast(pa.binary()), len(parts), task, before)
            self.unkeyed[topic] = before + keys.null_count
            split = []
            for index in pc.unique(target).to_pylist():
                chosen = rows.filter(pc.equal(target, index))
                split.append((parts[index], chosen))
        for target_topic, chosen in split:
            first = base + self.next_seq.get(target_topic, 0)
            self.next_seq[target_topic] = first - base + chosen.num_rows
            producer = self._producer(target_topic)
            # rows an earlier attempt of this micro-batch stored already are not sent again
            done = min(chosen.num_rows, max(0, producer.last_sequence_id - first + 1))
            self.skipped += done
            if done < chosen.num_rows:
                self._send(producer, chosen.slice(done), first + done)

    def _send(self, producer: Producer, rows: pa.RecordBatch, sequence_id: int | None) -> None:
        names = rows.schema.names
        self.futures.extend(
            producer.send_arrow(
                rows,
                key="key" if "key" in names else None,
                properties="properties" if "properties" in names else None,
                event_time="event_time" if "event_time" in names else None,
                sequence_id=sequence_id,
            )
        )


class PigeonBatchWriter(DataSourceArrowWriter):
    """``df.write.format("pigeon")``: at-least-once (a retried task sends its rows again)."""

    def __init__(self, opts: SinkOptions, schema: StructType, overwrite: bool) -> None:
        if overwrite:
            raise OptionError(["the pigeon sink only appends; use mode('append')"])
        _check_input(schema, opts)
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PigeonCommitMessage:
        return _Task(self.opts, None).write(iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        rows = sum(m.rows for m in messages if isinstance(m, PigeonCommitMessage))
        log.info("pigeon batch write committed rows=%s", rows)


class PigeonStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("pigeon")``: exactly-once (see the module docstring)."""

    def __init__(self, opts: SinkOptions, schema: StructType, overwrite: bool) -> None:
        _check_input(schema, opts)
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PigeonCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        batch_id = ctx.getLocalProperty("streaming.sql.batchId") if ctx else None
        query_id = ctx.getLocalProperty("sql.streaming.queryId") if ctx else None
        if ctx is None or batch_id is None or query_id is None:
            raise RuntimeError(
                "pigeon streaming sink: no streaming batch id / query id in the task"
            )
        task = _Task(self.opts, (query_id, ctx.partitionId(), int(batch_id)))
        return task.write(iterator, sort=self.opts.write_order == "sorted")

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        done = [m for m in messages if isinstance(m, PigeonCommitMessage)]
        log.info(
            "pigeon stream write committed batch=%s rows=%s skipped=%s",
            batchId,
            sum(m.rows for m in done),
            sum(m.skipped for m in done),
        )

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning("pigeon stream write aborted batch=%s (it is re-run exactly once)", batchId)
