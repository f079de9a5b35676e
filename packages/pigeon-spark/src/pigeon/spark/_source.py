"""The ``pigeon`` data source: batch and micro-batch reads, and the entry point for writes.

Planning (which partitions, which offsets) runs on the driver; every Spark task then does
a *pure range read* of one ``[start, end)`` slice of one partition through a short-lived
non-durable cursor (:mod:`pigeon.client._range`) and turns the stored entries into Arrow
record batches (:mod:`pigeon.spark._arrow`). Nothing is acknowledged and nothing is kept
on the broker, so re-running a task or a micro-batch reads exactly the same rows.

Topics with an AVRO or JSON schema (``decodeSchema``, on by default): ``load()`` takes
the topics' latest schema from the registry and makes ``value`` a struct of the record's
fields (:mod:`pigeon.spark._avro`), the raw bytes a last ``data`` column. The schema goes
into the ``value`` field's metadata, so every task of the query, and every micro-batch of
a stream, decodes to the same reader schema; values written with other versions are
resolved from their writer's schema, fetched once per version and process.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    DataType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from pigeon.client import Client
from pigeon.client.ranges import (
    offsets_for_timestamp,
    partition_offsets,
    read_range,
    topic_schema,
)
from pigeon.core import TopicName
from pigeon.core.errors import AuthorizationError, TopicNotFound
from pigeon.spark._arrow import DATA_COLUMN, SOURCE_COLUMNS, record_batches
from pigeon.spark._avro import (
    DECODED_TYPES,
    DecodeReport,
    UnsupportedSchema,
    ValueDecoder,
    ValueSchema,
)
from pigeon.spark._clients import client_for
from pigeon.spark._options import (
    OptionError,
    SourceOptions,
    check_names,
    parse_sink_options,
    parse_source_options,
)
from pigeon.spark._plan import (
    OffsetRange,
    Offsets,
    PartitionState,
    by_timestamp,
    cap,
    rate_limit,
    resolve,
    sorted_offsets,
    split_ranges,
    trigger_due,
)

__all__ = [
    "DataLossError",
    "PigeonDataSource",
    "PigeonInputPartition",
    "source_schema",
]

log = logging.getLogger(__name__)

_SPARK_TYPES: dict[str, DataType] = {
    "binary": BinaryType(),
    "string": StringType(),
    "int": IntegerType(),
    "bigint": LongType(),
    "timestamp": TimestampType(),
    "map<string,string>": MapType(StringType(), StringType()),
}


#: Metadata keys of the decoded ``value`` field: the schema it was decoded to.
SCHEMA_TYPE_KEY = "pigeon.schema.type"
SCHEMA_DEFINITION_KEY = "pigeon.schema.definition"


def source_schema(include_properties: bool, value: ValueSchema | None = None) -> StructType:
    """The source's Spark schema (``properties`` only with ``includeProperties``).

    With ``value`` (a topic's AVRO or JSON schema) ``value`` is the decoded record, with
    the schema in its field metadata, and ``data`` (binary) the last column.
    """
    from pyspark.sql.pandas.types import from_arrow_type

    cols = SOURCE_COLUMNS if include_properties else SOURCE_COLUMNS[:-1]
    fields = [StructField(name, _SPARK_TYPES[kind]) for name, kind in cols]
    if value is not None:
        fields[1] = StructField(
            "value",
            from_arrow_type(value.arrow_type()),
            metadata={SCHEMA_TYPE_KEY: value.type, SCHEMA_DEFINITION_KEY: value.definition},
        )
        fields.append(StructField(DATA_COLUMN[0], _SPARK_TYPES[DATA_COLUMN[1]]))
    return StructType(fields)


def _value_schema_of(schema: Any) -> ValueSchema | None:
    """The decoded value's schema recorded in a source schema (None: not decoded)."""
    try:
        meta = schema["value"].metadata or {}
    except (KeyError, TypeError, IndexError):
        return None
    if SCHEMA_DEFINITION_KEY not in meta:
        return None
    return ValueSchema(str(meta.get(SCHEMA_TYPE_KEY, "AVRO")), str(meta[SCHEMA_DEFINITION_KEY]))


class DataLossError(RuntimeError):
    """Offsets to be read were deleted (by retention) first; ``failOnDataLoss`` is true."""


class PigeonInputPartition(InputPartition):
    """Offsets ``[start, end)`` of one topic partition: the work of one Spark task."""

    def __init__(self, topic: str, start: int, end: int) -> None:
        super().__init__((topic, start, end))
        self.topic = topic
        self.start = start
        self.end = end

    def __repr__(self) -> str:
        return f"PigeonInputPartition({self.topic!r}, {self.start}, {self.end})"


# ------------------------------------------------------------------------------ planning


def _partition_topics(client: Client, opts: SourceOptions) -> list[str]:
    """The partition topics to read (a pattern is matched against full base names)."""
    if opts.pattern is None:
        topics = list(opts.topics)
    else:
        regex = re.compile(opts.pattern)
        topics = [t for t in client.list_topics(opts.pattern_namespace) if regex.fullmatch(t)]
    for t in topics:
        if not TopicName.parse(t).persistent:
            raise OptionError([f"{t} is non-persistent: it keeps no offsets to read"])
    return topics


def _value_schema(client: Client, opts: SourceOptions) -> ValueSchema | None:
    """The latest AVRO/JSON schema shared by the read topics (None: none has one);
    OptionError if they have different ones or it has no Spark column type."""
    if not opts.decode_schema:
        return None
    bases = dict.fromkeys(TopicName.parse(t).base.full for t in _partition_topics(client, opts))
    found: dict[tuple[str, str], list[str]] = {}
    for topic in bases:
        latest = topic_schema(client, topic)
        if latest is not None and latest[1] in DECODED_TYPES:
            found.setdefault((latest[1], latest[2]), []).append(topic)
    if not found:
        return None
    if len(found) > 1:
        which = "; ".join(
            f"{', '.join(ts)}: {kind} {json.loads(d).get('name', '?')}"
            for (kind, d), ts in found.items()
        )
        raise OptionError(
            [
                f"the topics have different schemas ({which}): read them separately, "
                "or set decodeSchema=false to read the raw bytes"
            ]
        )
    ((kind, definition), topics), *_ = found.items()
    value = ValueSchema(kind, definition)
    try:
        value.arrow_type()
    except (UnsupportedSchema, ValueError, KeyError, TypeError) as exc:
        raise OptionError(
            [
                f"the {kind} schema of {topics[0]} has no Spark column type: {exc}; set "
                "decodeSchema=false to read the raw bytes"
            ]
        ) from None
    return value


def _require_topics(client: Client, opts: SourceOptions) -> None:
    """TopicNotFound for a named topic that does not exist, before anything attaches to
    it (attaching would create it), unless ``allowAutoTopicCreation``: batch and
    streaming reads alike (a stream checks when it plans its first micro-batch)."""
    if opts.pattern is not None or opts.allow_auto_topic_creation:
        return
    listed: dict[str, set[str]] = {}
    missing = []
    for topic in opts.topics:
        name = TopicName.parse(topic)
        namespace = name.namespace_name
        if namespace not in listed:
            try:
                listed[namespace] = set(client.list_topics(namespace))
            except AuthorizationError:
                return  # a role that may read but not list: the read itself decides
        if name.full not in listed[namespace] and name.base.full not in listed[namespace]:
            missing.append(name.full)
    if missing:
        raise TopicNotFound(
            f"topic(s) {', '.join(missing)} do not exist: create them first, or set "
            "allowAutoTopicCreation=true to have the read create them (empty)"
        )


def _states(client: Client, opts: SourceOptions) -> dict[str, PartitionState]:
    topics = _partition_topics(client, opts)
    if not topics:
        return {}
    return {
        t: PartitionState(e, n) for t, (e, n) in sorted(partition_offsets(client, topics).items())
    }


def _starting(
    client: Client, opts: SourceOptions, states: dict[str, PartitionState], default: str
) -> Offsets:
    at_time = None
    spec = opts.starting
    option = "startingOffsets"
    try:
        if opts.starting_timestamp is not None and states:
            at_time = offsets_for_timestamp(client, list(states), opts.starting_timestamp)
        elif opts.starting_by_timestamp is not None:
            option = "startingOffsetsByTimestamp"
            spec = _at_times(
                client, by_timestamp(opts.starting_by_timestamp, states, option=option)
            )
        return resolve(spec, states, default=default, option=option, at_time=at_time)
    except ValueError as exc:
        raise OptionError([str(exc)]) from None


def _at_times(client: Client, times: dict[str, int]) -> Offsets:
    """Per partition, its first offset at/after its own time (one look-up per time)."""
    groups: dict[int, list[str]] = {}
    for topic, ms in times.items():
        groups.setdefault(ms, []).append(topic)
    out: Offsets = {}
    for ms, topics in groups.items():
        out.update(offsets_for_timestamp(client, topics, ms))
    return out


def _input_partitions(ranges: list[OffsetRange], opts: SourceOptions) -> list[InputPartition]:
    split = split_ranges(ranges, opts.min_partitions, opts.max_records_per_partition)
    return [PigeonInputPartition(*r) for r in split]


# ------------------------------------------------------------------------------ reading


_writers_lock = threading.Lock()
#: (service URL, base topic, header version) -> (type, definition) or None: versions are
#: never reused, so a process keeps what it fetched.
_writers: dict[tuple[str, str, int], tuple[str, str] | None] = {}
_decoders: dict[ValueSchema, ValueDecoder] = {}


def _writer_lookup(client: Client, opts: SourceOptions, base: str) -> Any:
    def writer(header_version: int) -> tuple[str, str] | None:
        key = (opts.service_url, base, header_version)
        with _writers_lock:
            if key in _writers:
                return _writers[key]
        found = topic_schema(client, base, header_version - 1)
        if found is None:
            log.warning(
                "schema version %d of %s not found; decoding its values with the read's schema",
                header_version - 1,
                base,
            )
        written = None if found is None else (found[1], found[2])
        with _writers_lock:
            _writers[key] = written
        return written

    return writer


def _decoder(value: ValueSchema) -> ValueDecoder:
    with _writers_lock:
        decoder = _decoders.get(value)
        if decoder is None:
            decoder = _decoders[value] = ValueDecoder(value)
        return decoder


def _read(
    opts: SourceOptions, partition: InputPartition, value: ValueSchema | None = None
) -> Iterator[pa.RecordBatch]:
    """*executor*: the rows of one offset range as Arrow record batches (``value``
    decoded to that schema when given)."""
    if not isinstance(partition, PigeonInputPartition):
        return  # Spark plans one empty InputPartition(None) when there is nothing to read
    client = client_for(opts.service_url, opts.security)
    name = TopicName.parse(partition.topic)
    decode = None
    value_type = None
    failures = DecodeReport()
    if value is not None:
        decoder = _decoder(value)
        writer = _writer_lookup(client, opts, name.base.full)
        value_type = decoder.type

        def decode(values: pa.Array, versions: pa.Array) -> pa.Array:
            decoded, report = decoder.decode(values, versions, writer)
            if report.failed:
                if failures.first is None:
                    failures.first = report.first
                failures.failed += report.failed
            return decoded

    def missing(topic: str, first: int, end: int) -> None:
        what = f"offsets [{first}, {end}) of {topic} were deleted (retention) before they were read"
        if opts.fail_on_data_loss:
            raise DataLossError(
                f"{what}. Set failOnDataLoss=false to skip lost data instead of failing."
            )
        log.warning("%s; skipping them (failOnDataLoss=false)", what)

    with read_range(
        client,
        partition.topic,
        partition.start,
        partition.end,
        idle_timeout=opts.poll_timeout_ms / 1000,
        on_missing=missing,
    ) as entries:
        yield from record_batches(
            entries,
            topic=name.base.full,
            partition=name.partition_index,
            start=partition.start,
            end=partition.end,
            codecs=client.codecs,
            include_properties=opts.include_properties,
            decode=decode,
            value_type=value_type,
        )
    if failures.first is not None:
        _, version, error = failures.first
        log.warning(
            "%d values of %s offsets [%d, %d) did not decode (schema version %d: %s); "
            "their value is null, their bytes are in data",
            failures.failed,
            partition.topic,
            partition.start,
            partition.end,
            version - 1,
            error,
        )


class PigeonBatchReader(DataSourceReader):
    def __init__(self, opts: SourceOptions, value: ValueSchema | None = None) -> None:
        self.opts = opts
        self.value = value

    def partitions(self) -> Sequence[InputPartition]:
        opts = self.opts
        client = client_for(opts.service_url, opts.security)
        _require_topics(client, opts)
        states = _states(client, opts)
        start = _starting(client, opts, states, "earliest")
        try:
            if opts.ending_timestamp is not None:
                end = sorted_offsets(
                    offsets_for_timestamp(client, list(states), opts.ending_timestamp)
                    if states
                    else {}
                )
            else:
                end = resolve(opts.ending, states, default="latest", option="endingOffsets")
        except ValueError as exc:
            raise OptionError([str(exc)]) from None
        ranges = []
        for topic in states:
            if start[topic] > end[topic]:
                raise OptionError(
                    [f"starting offset {start[topic]} of {topic} is past its end {end[topic]}"]
                )
            ranges.append(OffsetRange(topic, start[topic], end[topic]))
        return _input_partitions(ranges, opts)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(self.opts, partition, self.value)


class PigeonStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reads; an offset is ``{partition topic: next offset}``.

    Partitions that appear while the query runs (a partitioned topic grew, or a new topic
    matches ``topicsPattern``) are read from offset 0.
    """

    def __init__(self, opts: SourceOptions, value: ValueSchema | None = None) -> None:
        self.opts = opts
        self.value = value
        self._target: Offsets | None = None
        self._initial: Offsets | None = None
        #: monotonic time of the last micro-batch planned (minOffsetsPerTrigger)
        self._last_trigger: float | None = None

    def initialOffset(self) -> dict[str, int]:
        # Spark asks more than once (and again for a first micro-batch it re-runs after a
        # restart): answer the same within this run.
        if self._initial is None:
            client = client_for(self.opts.service_url, self.opts.security)
            _require_topics(client, self.opts)
            self._initial = _starting(client, self.opts, _states(client, self.opts), "latest")
        return dict(self._initial)

    def _latest(self, start: dict[str, int]) -> Offsets:
        states = _states(client_for(self.opts.service_url, self.opts.security), self.opts)
        latest = {t: max(s.latest, start.get(t, 0)) for t, s in states.items()}
        for topic, offset in start.items():
            latest.setdefault(topic, offset)  # a partition that went away stays where it was
        return latest

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_offsets_per_trigger:
            return ReadMaxRows(self.opts.max_offsets_per_trigger)
        if self.opts.min_offsets_per_trigger:
            return ReadMinRows(self.opts.min_offsets_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = sorted_offsets(self._latest({}))

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        start = {k: int(v) for k, v in start.items()}
        latest = self._latest(start)
        if self._target is not None:
            latest = cap(latest, start, self._target)
        elif self.opts.min_offsets_per_trigger and not isinstance(limit, ReadAllAvailable):
            # Trigger.AvailableNow and Once read everything: no waiting for a minimum
            now = time.monotonic()
            waited = None if self._last_trigger is None else (now - self._last_trigger) * 1000
            new = sum(max(0, end - start.get(t, 0)) for t, end in latest.items())
            if not trigger_due(
                new, self.opts.min_offsets_per_trigger, waited, self.opts.max_trigger_delay_ms
            ):
                return sorted_offsets(start)
            self._last_trigger = now
        if isinstance(limit, ReadMaxRows):
            return rate_limit(start, latest, limit.max_rows)
        return sorted_offsets(latest)

    def reportLatestOffset(self) -> dict[str, int] | None:
        return sorted_offsets(self._latest({}))

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        ranges = [OffsetRange(t, int(start.get(t, 0)), int(e)) for t, e in end.items()]
        return _input_partitions([r for r in ranges if r.end > r.start], self.opts)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(self.opts, partition, self.value)

    def commit(self, end: dict[str, int]) -> None:
        return None  # nothing is held on the broker


# ------------------------------------------------------------------------------ the source


class PigeonDataSource(DataSource):
    """``format("pigeon")``: read and write PigeonMQ topics.

    Register once per session: ``spark.dataSource.register(PigeonDataSource)``.
    """

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        check_names(options)  # fails load()/save() on misspelled option names

    @classmethod
    def name(cls) -> str:
        return "pigeon"

    def _source_options(self, mode: str) -> SourceOptions:
        return parse_source_options(self.options, mode=mode)  # type: ignore[arg-type]

    def schema(self) -> StructType:
        # Called by load(): every read option is checked here, before any query runs,
        # and the topics' schema (if any) is looked up.
        opts = self._source_options("any")
        value = None
        if opts.decode_schema:
            value = _value_schema(client_for(opts.service_url, opts.security), opts)
        return source_schema(opts.include_properties, value)

    def reader(self, schema: StructType) -> DataSourceReader:
        opts = self._source_options("batch")
        return PigeonBatchReader(opts, _check_schema(schema, opts))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        opts = self._source_options("stream")
        return PigeonStreamReader(opts, _check_schema(schema, opts))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:
        from pigeon.spark._sink import PigeonBatchWriter

        return PigeonBatchWriter(parse_sink_options(self.options), schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamArrowWriter:
        from pigeon.spark._sink import PigeonStreamWriter

        return PigeonStreamWriter(parse_sink_options(self.options), schema, overwrite)


def _check_schema(schema: Any, opts: SourceOptions) -> ValueSchema | None:
    """The decoded value's schema of a read whose schema is ``schema`` (as load() made
    it); OptionError if the user gave another."""
    value = _value_schema_of(schema) if opts.decode_schema else None
    try:
        expected = source_schema(opts.include_properties, value)
    except (UnsupportedSchema, ValueError, KeyError, TypeError):
        expected = source_schema(opts.include_properties)
    if schema != expected:
        raise OptionError(
            [
                "the pigeon source has a fixed schema; do not set one "
                f"(expected {expected.simpleString()}, got {schema.simpleString()})"
            ]
        )
    return value
