"""Kafka Fetch (long poll) and ListOffsets over the managed ledger's read path.

A fetch reads stored entries from the one holding the fetch offset on (a batch may
start before the offset: Kafka clients skip the records below it, as they do inside
compressed batches) and answers each as a RecordBatch: an entry a Kafka producer
stored is sent as it was stored with its base offset set (no record is touched); an
entry a native producer stored is converted once and the result kept in a small cache.
The high watermark is the end of what is stored on the ack quorum; without
transactions the last stable offset equals it, whatever the isolation level.

Where the previous fetch of a partition stopped is remembered (offset -> position), so
a consumer reading on never searches the ledger; any other offset is found by a binary
search over the entries' first offsets.

A topic with ``cleanup.policy=compact`` (see ``_topic_configs``) that has a compacted
ledger is read as Kafka's cleaned log: offsets below the compaction horizon come from
the compacted view -- each of its entries as one RecordBatch holding only the messages
kept (their own offsets, so the offsets between them are gaps, as after Kafka's log
cleaner; see ``kafka_batch_of_kept``) -- and the log goes on from the horizon.  The log
start offset is then the first offset of the compacted view.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import trio
from kio.schema.errors import ErrorCode

from pigeon.broker._kafka import KafkaConnection, ms
from pigeon.broker._kafka_wire import (
    NO_LEADER_EPOCH,
    ZERO,
    FetchAnswer,
    build,
    error_code,
    part,
    response_type,
)
from pigeon.broker._topic_configs import is_compacted
from pigeon.core.batch import ENTRY_HEADER_SIZE, decode_batch
from pigeon.core.errors import PigeonError, TopicNotFound
from pigeon.core.kafka_records import kafka_batch_of_entry, kafka_batch_of_kept

if TYPE_CHECKING:
    from pigeon.broker._kafka import KafkaFrontDoor
    from pigeon.broker._ledger import ManagedLedger
    from pigeon.broker._ledger_compaction import CompactedEntry, CompactedLedger
    from pigeon.broker._ledger_state import Entry, Position

__all__ = ["HANDLERS", "note_answers", "partition_ledger"]

log = logging.getLogger(__name__)

#: remembered fetch positions (offset where a fetch stopped -> the next entry's position)
POSITIONS = 4096
#: bytes of converted native entries kept
CONVERTED_BYTES = 64 * 1024 * 1024
#: entries read from the ledger at a time
READ_ENTRIES = 256


class FetchCache:
    """Where fetches stopped, and entries converted to RecordBatches."""

    def __init__(self) -> None:
        self.positions: OrderedDict[tuple[str, int], Position] = OrderedDict()
        #: (topic, compacted ledger id, offset) -> the compacted entry id holding it
        self.compacted_positions: OrderedDict[tuple[str, int, int], int] = OrderedDict()
        #: (topic, compacted ledger id) -> the first offset of the compacted view
        self.compacted_starts: dict[tuple[str, int], int] = {}
        #: (topic, segment or compacted ledger id, entry id) -> RecordBatch
        self.converted: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self.converted_bytes = 0

    def remember(self, topic: str, offset: int, pos: Position) -> None:
        self.positions[(topic, offset)] = pos
        self.positions.move_to_end((topic, offset))
        while len(self.positions) > POSITIONS:
            self.positions.popitem(last=False)

    def remember_compacted(self, topic: str, ledger_id: int, offset: int, entry_id: int) -> None:
        key = (topic, ledger_id, offset)
        self.compacted_positions[key] = entry_id
        self.compacted_positions.move_to_end(key)
        while len(self.compacted_positions) > POSITIONS:
            self.compacted_positions.popitem(last=False)

    def batch(self, topic: str, entry: Entry, codecs: Any) -> list[Any]:
        key = (topic, entry.segment_id, entry.entry_id)
        found = self.converted.get(key)
        if found is not None:
            return [found]
        return self._keep(key, kafka_batch_of_entry(entry.data, codecs))

    def kept_batch(
        self, topic: str, ledger_id: int, item: CompactedEntry, codecs: Any
    ) -> list[Any]:
        """The RecordBatch of a compacted entry (only the messages it keeps)."""
        key = (topic, ledger_id, item.entry_id)
        found = self.converted.get(key)
        if found is not None:
            return [found]
        return self._keep(key, kafka_batch_of_kept(item.entry.data, item.kept, codecs))

    def _keep(self, key: tuple[str, int, int], parts: list[Any]) -> list[Any]:
        if all(isinstance(p, bytes) for p in parts):
            # converted (a stored Kafka batch sent whole comes back as views: not kept)
            joined = parts[0] if len(parts) == 1 else b"".join(parts)
            self.converted[key] = joined
            self.converted_bytes += len(joined)
            while self.converted_bytes > CONVERTED_BYTES and self.converted:
                _, dropped = self.converted.popitem(last=False)
                self.converted_bytes -= len(dropped)
            return [joined]
        return parts


def _cache(door: KafkaFrontDoor) -> FetchCache:
    cache: FetchCache | None = door.state.get("fetch")
    if cache is None:
        cache = door.state["fetch"] = FetchCache()
    return cache


async def partition_ledger(door: KafkaFrontDoor, kafka_topic: str, index: int) -> ManagedLedger:
    """The ledger of a Kafka partition served here (opened on first use).

    :raises TopicNotFound: no such topic or partition.
    :raises NotOwner: another broker serves it.
    """
    partitions = await door.core.partitions_of(door.topic_name(kafka_topic))
    if not 0 <= index < partitions:
        raise TopicNotFound(f"topic {kafka_topic!r} has no partition {index}")
    topic = await door.core.get_topic(door.partition_name(kafka_topic, index))
    ledger: ManagedLedger = topic.as_persistent().ledger
    return ledger


async def fetch(conn: KafkaConnection, request: Any) -> Any:
    return conn.spawn(lambda: _fetch(conn, request))


async def _fetch(conn: KafkaConnection, request: Any) -> Any:
    door = conn.door
    version = type(request).__version__
    deadline = trio.current_time() + min(ms(request.max_wait), 30.0)
    max_bytes = getattr(request, "max_bytes", 0x7FFFFFFF)
    wanted = [(t.topic, p) for t in request.topics for p in t.partitions]
    while True:
        ledgers: dict[tuple[str, int], Any] = {}
        compacted: set[str] = set()
        for kafka_topic, p in wanted:
            try:
                await conn.authorize("consume", kafka_topic)
                ledgers[(kafka_topic, p.partition)] = await partition_ledger(
                    door, kafka_topic, p.partition
                )
                if await is_compacted_topic(door, kafka_topic):
                    compacted.add(kafka_topic)
            except PigeonError as exc:
                ledgers[(kafka_topic, p.partition)] = exc
        # watched from before the read: an entry stored while it runs ends the wait
        live = [x for x in ledgers.values() if not isinstance(x, BaseException)]
        woken = trio.Event()
        wake = woken.set
        for ledger in live:
            ledger.watch_entries(wake)
        try:
            answers, total, failed = await _read(door, wanted, ledgers, max_bytes, compacted)
            if failed or total >= request.min_bytes or trio.current_time() >= deadline or not live:
                if failed or total == 0 or conn.fetch_notes:
                    note_answers(conn, wanted, answers, total)
                return _response(version, answers)
            with trio.move_on_at(deadline):
                await woken.wait()  # one event, no task per partition
        finally:
            for ledger in live:
                ledger.unwatch_entries(wake)


def note_answers(
    conn: KafkaConnection,
    wanted: list[tuple[str, Any]],
    answers: list[tuple[str, dict[str, Any]]],
    total: int,
) -> None:
    """Say in one line when a partition's fetch starts answering an error code, or
    nothing at all although its log holds more (the two ways a Kafka consumer stalls
    without a word to its application), and in one more when it answers records again.

    ``conn.fetch_notes`` keeps, per (topic, partition) noted, the code (-1: empty) and
    how many fetches answered it; a connection has one entry per stalled partition."""
    notes = conn.fetch_notes
    for (kafka_topic, p), (_, f) in zip(wanted, answers, strict=True):
        key = (kafka_topic, p.partition)
        code = int(f["error_code"])
        if not code and total == 0 and p.fetch_offset < f["high_watermark"]:
            code = -1  # nothing, with records to give
        noted = notes.get(key)
        if not code:
            if noted is not None and (f["records"] or p.fetch_offset >= f["high_watermark"]):
                del notes[key]
                log.info(
                    "kafka fetch answers again conn=%s client=%s topic=%s partition=%d"
                    " offset=%d after=%d fetches",
                    conn.name,
                    conn.client_id,
                    kafka_topic,
                    p.partition,
                    p.fetch_offset,
                    noted[1],
                )
            continue
        if noted is not None and noted[0] == code:
            notes[key] = (code, noted[1] + 1)
            continue
        notes[key] = (code, 1)
        if code < 0:
            log.warning(
                "kafka fetch answered no records below the high watermark conn=%s"
                " client=%s topic=%s partition=%d offset=%d high_watermark=%d",
                conn.name,
                conn.client_id,
                kafka_topic,
                p.partition,
                p.fetch_offset,
                f["high_watermark"],
            )
        else:
            log.info(
                "kafka fetch answered an error conn=%s client=%s topic=%s partition=%d"
                " offset=%d error=%s",
                conn.name,
                conn.client_id,
                kafka_topic,
                p.partition,
                p.fetch_offset,
                ErrorCode(code).name,
            )


async def _read(
    door: KafkaFrontDoor,
    wanted: list[tuple[str, Any]],
    ledgers: dict[tuple[str, int], Any],
    max_bytes: int,
    compacted: set[str],
) -> tuple[list[tuple[str, Any]], int, bool]:
    cache = _cache(door)
    answers = []
    total = 0
    failed = False
    for kafka_topic, p in wanted:
        ledger = ledgers[(kafka_topic, p.partition)]
        fields: dict[str, Any] = {
            "partition_index": p.partition,
            "high_watermark": -1,
            "last_stable_offset": -1,
            "log_start_offset": -1,
            "aborted_transactions": None,
            "preferred_read_replica": -1,
            "records": [],
        }
        if isinstance(ledger, BaseException):
            failed = True
            answers.append((kafka_topic, {**fields, "error_code": error_code(ledger)}))
            continue
        end = ledger.stored_offset
        view, horizon = _view_of(ledger, kafka_topic in compacted)
        try:
            start = await _log_start(cache, ledger, view)
        except PigeonError as exc:
            failed = True
            answers.append((kafka_topic, {**fields, "error_code": error_code(exc)}))
            continue
        fields.update(high_watermark=end, last_stable_offset=end, log_start_offset=start)
        offset = p.fetch_offset
        if offset < start or offset > end:
            failed = True
            answers.append((kafka_topic, {**fields, "error_code": ErrorCode.offset_out_of_range}))
            continue
        budget = min(p.partition_max_bytes, max_bytes - total)
        try:
            parts = await _read_partition(
                door,
                cache,
                ledger,
                offset,
                end,
                budget,
                first=total == 0,
                view=view,
                horizon=horizon,
            )
        except PigeonError as exc:
            failed = True
            answers.append((kafka_topic, {**fields, "error_code": error_code(exc)}))
            continue
        total += sum(len(b) for b in parts)
        answers.append((kafka_topic, {**fields, "error_code": ErrorCode.none, "records": parts}))
    return answers, total, failed


async def _read_partition(
    door: KafkaFrontDoor,
    cache: FetchCache,
    ledger: Any,
    offset: int,
    end: int,
    budget: int,
    *,
    first: bool,
    view: CompactedLedger | None = None,
    horizon: int = 0,
) -> list[Any]:
    """RecordBatches from ``offset`` on, within ``budget`` bytes (at least one batch if
    ``first``: KIP-74, so a batch larger than the limit still gets through); below
    ``horizon`` from the compacted ``view`` (when given)."""
    topic = str(ledger.topic)
    parts: list[Any] = []
    size = 0
    if view is not None and offset < horizon:
        size, done = await _read_compacted(
            door, cache, ledger, view, horizon, offset, budget, parts, first=first
        )
        if not done:
            return parts
        offset = max(horizon, ledger.first_offset)  # the log goes on from there
    if offset >= end:
        return parts
    pos = cache.positions.get((topic, offset))
    if pos is None:
        pos = await ledger.position_for_offset(offset)
    while size < budget:
        entries = await ledger.read(pos, max_entries=READ_ENTRIES, max_bytes=max(budget - size, 1))
        if not entries:
            break
        for entry in entries:
            batch = cache.batch(topic, entry, door.core.codecs)
            length = sum(len(b) for b in batch)
            if size + length > budget and (parts or not first):
                break
            parts.extend(batch)
            size += length
            pos = ledger.next_position(entry.position)
            cache.remember(topic, entry.first_offset + entry.num_messages, pos)
        else:
            continue
        break
    return parts


async def is_compacted_topic(door: KafkaFrontDoor, kafka_topic: str) -> bool:
    """Has ``kafka_topic`` ``cleanup.policy`` compact (its configs as cached)?"""
    return is_compacted(await door.core.topic_configs.get(door.topic_name(kafka_topic)))


def _view_of(ledger: Any, compact: bool) -> tuple[CompactedLedger | None, int]:
    """(compacted view, the offset below which a Kafka fetch reads it).  A topic with
    ``cleanup.policy`` compact reads it below its horizon; one that was compacted and
    is no longer (policy delete) only below the log's first offset, so the latest value
    of every key the log no longer holds stays readable (as the segments Kafka's
    cleaner wrote stay when the policy goes back to delete)."""
    c: CompactedLedger | None = ledger.compacted
    if c is None:
        return None, 0
    horizon = c.horizon if compact else min(c.horizon, int(ledger.first_offset))
    return c, horizon


async def _log_start(cache: FetchCache, ledger: Any, view: CompactedLedger | None) -> int:
    """The partition's log start offset: the first stored, or the compacted view's."""
    if view is None:
        return int(ledger.first_offset)
    key = (str(ledger.topic), view.id)
    first = cache.compacted_starts.get(key)
    if first is None:
        items = await ledger.read_compacted(view, 0, 1)
        first = items[0].entry.first_offset if items else view.horizon
        if len(cache.compacted_starts) >= POSITIONS:
            cache.compacted_starts.clear()
        cache.compacted_starts[key] = first
    return min(int(ledger.first_offset), first)


async def _compacted_entry_for(ledger: Any, view: CompactedLedger, offset: int) -> int:
    """The first entry of the compacted ledger that ends past ``offset`` (``entries``:
    none), by a binary search (its entries are in offset order)."""
    lo, hi = 0, view.entries
    while lo < hi:
        mid = (lo + hi) // 2
        items = await ledger.read_compacted(view, mid, 1)
        if not items:  # pragma: no cover - the recorded count is what was written
            hi = mid
            continue
        entry = items[0].entry
        if entry.first_offset + entry.num_messages > offset:
            hi = mid
        else:
            lo = mid + 1
    return lo


async def _read_compacted(
    door: KafkaFrontDoor,
    cache: FetchCache,
    ledger: Any,
    view: CompactedLedger,
    horizon: int,
    offset: int,
    budget: int,
    parts: list[Any],
    *,
    first: bool,
) -> tuple[int, bool]:
    """RecordBatches of the compacted ``view`` from ``offset`` on, up to ``horizon``,
    added to ``parts`` (within ``budget`` bytes, at least one if ``first``); (bytes
    added, whether the view was read up to ``horizon``)."""
    topic = str(ledger.topic)
    entry_id = cache.compacted_positions.get((topic, view.id, offset))
    if entry_id is None:
        entry_id = await _compacted_entry_for(ledger, view, offset)
    size = 0
    while size < budget:
        items = await ledger.read_compacted(view, entry_id, READ_ENTRIES)
        if not items:
            return size, True
        for item in items:
            if item.entry.first_offset >= horizon:
                return size, True
            batch = cache.kept_batch(topic, view.id, item, door.core.codecs)
            length = sum(len(b) for b in batch)
            if size + length > budget and (parts or not first):
                return size, False
            parts.extend(batch)
            size += length
            entry_id = item.entry_id + 1
            e = item.entry
            cache.remember_compacted(topic, view.id, e.first_offset + e.num_messages, entry_id)
    return size, False


def _response(version: int, answers: list[tuple[str, dict[str, Any]]]) -> FetchAnswer:
    """The answer, its records the stored buffers themselves (sent unjoined)."""
    topics: dict[str, list[Any]] = {}
    for kafka_topic, f in answers:
        topics.setdefault(kafka_topic, []).append(
            (
                f["partition_index"],
                int(f["error_code"]),
                f["high_watermark"],
                f["last_stable_offset"],
                f["log_start_offset"],
                f["records"],
            )
        )
    return FetchAnswer(version, list(topics.items()))


async def list_offsets(conn: KafkaConnection, request: Any) -> Any:
    door = conn.door
    cls = response_type(request)
    topics = []
    for t in request.topics:
        parts = []
        for p in t.partitions:
            fields: dict[str, Any] = {
                "partition_index": p.partition_index,
                "leader_epoch": NO_LEADER_EPOCH,
            }
            try:
                await conn.authorize("consume", t.name)
                ledger = await partition_ledger(door, t.name, p.partition_index)
                if p.timestamp == -2 and ledger.compacted is not None:
                    # earliest: the compacted view's start, if the log starts later
                    view, _horizon = _view_of(ledger, await is_compacted_topic(door, t.name))
                    offset = await _log_start(_cache(door), ledger, view)
                    timestamp = -1
                else:
                    offset, timestamp = await _offset_for(ledger, p.timestamp, door.core.codecs)
                fields.update(error_code=ErrorCode.none, offset=offset, timestamp=timestamp)
            except PigeonError as exc:
                fields.update(error_code=error_code(exc), offset=-1, timestamp=-1)
            parts.append(part(cls, "ListOffsetsPartitionResponse", **fields))
        topics.append(part(cls, "ListOffsetsTopicResponse", name=t.name, partitions=tuple(parts)))
    return build(cls, throttle_time=ZERO, topics=tuple(topics))


async def _offset_for(ledger: Any, timestamp: int, codecs: Any) -> tuple[int, int]:
    """(offset, timestamp) for ListOffsets: -2 earliest, -1 latest, else the first
    message whose Kafka timestamp (event time, or publish time when it has none) is at or
    after ``timestamp`` ms, found by a binary search over the entries' largest timestamps
    (as Kafka's time index does); (-1, -1) when there is none."""
    if timestamp == -2:
        return ledger.first_offset, -1
    if timestamp < 0:  # -1 latest (and -3 max timestamp: the end too)
        return ledger.stored_offset, -1
    places = [(seg.id, seg.last_entry_id + 1) for seg in ledger.segments if seg.last_entry_id >= 0]
    total = sum(count for _, count in places)

    def position(k: int) -> tuple[int, int]:
        for seg_id, count in places:
            if k < count:
                return (seg_id, k)
            k -= count
        raise AssertionError("unreachable")

    lo, hi = 0, total  # first entry whose largest timestamp reaches ``timestamp``
    while lo < hi:
        mid = (lo + hi) // 2
        times = await _entry_times(ledger, position(mid), codecs)
        if times and max(times) >= timestamp:
            hi = mid
        else:
            lo = mid + 1
    while lo < total:  # an entry nobody can read is passed over
        times = await _entry_times(ledger, position(lo), codecs)
        for i, t in enumerate(times):
            if t >= timestamp:
                entry = (await ledger.read(position(lo), max_entries=1))[0]
                return entry.first_offset + i, t
        lo += 1
    return -1, -1


async def _entry_times(ledger: Any, pos: tuple[int, int], codecs: Any) -> list[int]:
    """The Kafka timestamps of an entry's messages ([] if no replica holds it intact)."""
    try:
        entry = (await ledger.read(pos, max_entries=1))[0]
        batch = decode_batch(memoryview(entry.data)[ENTRY_HEADER_SIZE:], codecs)
    except (PigeonError, IndexError):
        return []
    n = entry.num_messages
    times = batch.event_times.tolist() if batch.event_times is not None else [0] * n
    return [t or entry.publish_time for t in times]


HANDLERS = {1: fetch, 2: list_offsets}
