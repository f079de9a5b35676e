"""Pure range reads: the stored entries that hold offsets ``[start, end)`` of one partition.

This is what a deterministic, replayable reader (the Spark connector) needs: no durable
state, no acknowledgements, and the same input range always yields the same messages.

* :func:`partition_offsets` — ``{partition topic: (earliest available, next offset)}``
  for every partition of a topic (a non-partitioned topic is its own single partition).
* :func:`offsets_for_timestamp` — per partition, the first offset whose broker publish
  time is at or after a timestamp (the next offset if there is none).
* :func:`read_range` — a :class:`RangeReader` over the raw stored entries (broker header
  + batch, see :mod:`pigeon.core._entry`) covering ``[start, end)``. Entries are whole:
  the first may begin before ``start`` and the last may end after ``end``; trimming the
  rows is the caller's job (the Spark connector does it on Arrow arrays).
* :func:`topic_schema` — one version of a topic's schema (``(version, type,
  definition)``, None without one): the batch header's ``schema_version`` is the registry
  version + 1, 0 = written without a schema.

Each call opens a short-lived non-durable subscription (a reader cursor) per partition
and removes it when done. Offsets that retention deleted before they were read are
reported through ``on_missing(topic, first, end)`` — ``[first, end)`` is gone — which
may raise to fail the read (Spark's ``failOnDataLoss``) or return to skip the gap.

Entries cross from the client's engine thread to the caller in the lists the broker
pushed them in (one hand-over per push, never per message); permits are granted in
windows of ``window`` messages as the caller consumes them.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

import trio

from pigeon.client._consumer_engine import ConsumerEngine, SubscribeOptions
from pigeon.client._consumer_handle import reader_subscription
from pigeon.client._engine import ClientEngine, ReceivedEntry
from pigeon.core.batch import unpack_entry_header
from pigeon.core.errors import InvalidArgument, PigeonError, SchemaNotFound, Timeout

if TYPE_CHECKING:
    from pigeon.client._sync import Client

__all__ = [
    "RangeReader",
    "offsets_for_timestamp",
    "partition_offsets",
    "partition_topics",
    "read_range",
    "topic_schema",
]

log = logging.getLogger(__name__)

MissingCallback = Callable[[str, int, int], None]

#: Messages granted to the broker ahead of what the caller has consumed.
DEFAULT_WINDOW = 20_000


async def _open_cursor(
    engine: ClientEngine,
    topic: str,
    sink: Callable[[list[ReceivedEntry]], None],
    *,
    start_offset: int = -1,
    permits: int = 0,
) -> ConsumerEngine:
    """*engine*: a non-durable exclusive cursor at ``start_offset`` (or the earliest)."""
    options = SubscribeOptions(
        topic,
        reader_subscription(),
        "exclusive",
        "earliest",
        durable=False,
        start_offset=start_offset,
        receiver_queue_size=permits,
    )
    cursor = ConsumerEngine(engine, options, sink)
    await cursor.start()
    return cursor


async def _drop_cursor(cursor: ConsumerEngine) -> None:
    """*engine*: remove the reader's subscription from the broker (close if that fails)."""
    with trio.CancelScope(shield=True):
        try:
            await cursor.unsubscribe()
        except PigeonError:
            try:
                await cursor.close()
            except PigeonError:
                pass


def _ignore(entries: list[ReceivedEntry]) -> None:
    return None


async def _partition_info(
    engine: ClientEngine, topic: str, timestamp: int | None
) -> tuple[int, int, int]:
    """*engine*: (earliest available, next offset, first offset at/after ``timestamp``)."""
    cursor = await _open_cursor(engine, topic, _ignore)
    try:
        info = await cursor.last_message_id()
        earliest, next_offset = int(info["markDeleteOffset"]), int(info["offset"]) + 1
        at_time = earliest
        if timestamp is not None:
            await cursor.seek(timestamp=int(timestamp))
            at_time = int((await cursor.last_message_id())["markDeleteOffset"])
        return earliest, max(earliest, next_offset), at_time
    finally:
        await _drop_cursor(cursor)


async def _gather(
    engine: ClientEngine, topics: list[str], timestamp: int | None
) -> dict[str, tuple[int, int, int]]:
    results: dict[str, tuple[int, int, int]] = {}

    async def one(topic: str) -> None:
        results[topic] = await _partition_info(engine, topic, timestamp)

    async with trio.open_nursery() as nursery:
        for t in topics:
            nursery.start_soon(one, t)
    return {t: results[t] for t in topics}


def partition_topics(client: Client, topic: str) -> list[str]:
    """Full names of the partitions of ``topic`` (``[topic]`` if it is not partitioned)."""
    names: list[str] = client.engine_thread.call(client.engine.partitioned_names, topic)
    return names


def _all_partitions(client: Client, topics: str | Sequence[str]) -> list[str]:
    names: list[str] = []
    for topic in [topics] if isinstance(topics, str) else topics:
        names.extend(n for n in partition_topics(client, topic) if n not in names)
    return names


def partition_offsets(client: Client, topics: str | Sequence[str]) -> dict[str, tuple[int, int]]:
    """``{partition topic: (earliest available offset, next offset)}`` of every partition.

    ``topics`` is a topic name or a list of them; each may be a partitioned topic, one of
    its partitions, or a plain topic. The earliest available offset is above 0 once
    retention has deleted the head. The partitions are asked concurrently.
    """
    names = _all_partitions(client, topics)
    info = client.engine_thread.call(_gather, client.engine, names, None)
    return {t: (e, n) for t, (e, n, _) in info.items()}


def offsets_for_timestamp(
    client: Client, topics: str | Sequence[str], timestamp_ms: int
) -> dict[str, int]:
    """Per partition, the first offset published at or after ``timestamp_ms`` (ms since
    the epoch); the partition's next offset when everything is older."""
    names = _all_partitions(client, topics)
    info = client.engine_thread.call(_gather, client.engine, names, int(timestamp_ms))
    return {t: at for t, (_e, _n, at) in info.items()}


async def _get_schema(engine: ClientEngine, topic: str, version: int) -> tuple[int, str, str]:
    conn = await engine.lookup_connection()
    result = await engine.request(
        conn, "getSchema", {"topic": topic, "version": version}, expect="schemaResponse"
    )
    info = result["schemaInfo"]
    return int(result["version"]), str(info["type"]), str(info["definition"])


def topic_schema(
    client: Client, topic: str, version: int | None = None
) -> tuple[int, str, str] | None:
    """``(registry version, type, definition)`` of version ``version`` of ``topic``'s
    schema (None: the latest), or None when the topic has no schema (or not that
    version). A partition's schema is its partitioned topic's; any broker answers.

    ``type`` is ``"AVRO"``, ``"JSON"``, ``"STRING"``...; for AVRO and JSON
    ``definition`` is the Avro record schema as JSON text.
    """
    try:
        found: tuple[int, str, str] = client.engine_thread.call(
            _get_schema, client.engine, topic, -1 if version is None else int(version)
        )
    except SchemaNotFound:
        return None
    return found


def _raise_missing(topic: str, first: int, end: int) -> None:
    raise InvalidArgument(
        f"offsets [{first}, {end}) of {topic} are no longer available (deleted by retention)"
    )


@dataclass(eq=False)
class RangeReader:
    """Iterates the stored entries holding offsets ``[start, end)`` of one partition.

    Use as a context manager (or call :meth:`close`): it owns a reader subscription on
    the broker. Iteration yields :class:`~pigeon.client._engine.ReceivedEntry` objects in
    offset order, each exactly once, and stops after the entry holding ``end - 1``.
    ``first_available`` is where the cursor really started (above ``start`` when
    retention deleted ``[start, first_available)``).
    """

    client: Client
    topic: str
    start: int
    end: int
    _: KW_ONLY
    window: int
    idle_timeout: float
    on_missing: MissingCallback
    _queue: queue.SimpleQueue[list[ReceivedEntry]] = field(
        init=False, default_factory=queue.SimpleQueue
    )
    _cursor: ConsumerEngine | None = field(init=False, default=None)
    _closed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.first_available = self.start
        self._granted_to = self.start

    # -- engine side

    def _sink(self, entries: list[ReceivedEntry]) -> None:
        self._queue.put(entries)

    async def _open(self) -> None:
        permits = min(self.window, self.end - self.start)
        self._cursor = await _open_cursor(
            self.client.engine, self.topic, self._sink, start_offset=self.start, permits=permits
        )
        self.topic = self._cursor.topic
        info = await self._cursor.last_message_id()
        self.first_available = int(info["markDeleteOffset"])
        self._granted_to = self.first_available + permits

    # -- caller side

    def open(self) -> RangeReader:
        if self.start < self.end:
            self.client.engine_thread.call(self._open)
            if self.first_available > self.start:
                self.on_missing(self.topic, self.start, min(self.first_available, self.end))
        return self

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        cursor, self._cursor = self._cursor, None
        if cursor is not None:
            try:
                self.client.engine_thread.call(_drop_cursor, cursor)
            except PigeonError as exc:
                log.info("range reader cleanup failed topic=%s error=%s", self.topic, exc)

    def _grant(self, consumed_to: int) -> None:
        """Keep ``window`` messages granted beyond what was consumed (never past end)."""
        target = min(self.end, consumed_to + self.window)
        missing = target - self._granted_to
        if missing >= self.window // 2 or (target == self.end and missing > 0):
            cursor = self._cursor
            if cursor is not None:
                self.client.engine_thread.soon(cursor.flow, missing)
            self._granted_to = target

    def __iter__(self) -> Iterator[ReceivedEntry]:
        expected = max(self.start, self.first_available)
        if expected >= self.end or self._cursor is None:
            return
        deadline = time.monotonic() + self.idle_timeout
        while expected < self.end:
            try:
                entries = self._queue.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise self._stalled(expected) from None
                continue
            deadline = time.monotonic() + self.idle_timeout
            for entry in entries:
                header = unpack_entry_header(entry.data)
                first, n = header.first_offset, header.num_messages
                if first + n <= expected:
                    continue  # redelivered after a reconnect: already yielded
                if first > expected:
                    self.on_missing(self.topic, expected, min(first, self.end))
                    if first >= self.end:
                        return
                expected = first + n
                yield entry
                if expected >= self.end:
                    return
            self._grant(expected)

    def _stalled(self, expected: int) -> PigeonError:
        cursor = self._cursor
        detail = ""
        if cursor is not None:
            try:
                info = self.client.engine_thread.call(cursor.last_message_id)
                detail = f"; the partition's last offset is {info['offset']}"
            except PigeonError:
                pass
        return Timeout(
            f"reading {self.topic} offsets [{self.start}, {self.end}): nothing arrived for "
            f"{self.idle_timeout}s at offset {expected}{detail}"
        )


def read_range(
    client: Client,
    topic: str,
    start: int,
    end: int,
    *,
    window: int = DEFAULT_WINDOW,
    idle_timeout: float = 30.0,
    on_missing: MissingCallback | None = None,
) -> RangeReader:
    """Open a :class:`RangeReader` over offsets ``[start, end)`` of partition ``topic``.

    ``on_missing(topic, first, end)`` is called when offsets ``[first, end)`` were deleted
    before they could be read; the default raises :class:`InvalidArgument`. A read that
    receives nothing for ``idle_timeout`` seconds raises :class:`Timeout`.
    """
    if start < 0 or end < start:
        raise InvalidArgument(f"bad offset range [{start}, {end}) for {topic}")
    if window < 1:
        raise InvalidArgument("window must be at least 1 message")
    reader = RangeReader(
        client,
        topic,
        start,
        end,
        window=window,
        idle_timeout=idle_timeout,
        on_missing=on_missing or _raise_missing,
    )
    try:
        return reader.open()
    except BaseException:
        reader.close()
        raise
