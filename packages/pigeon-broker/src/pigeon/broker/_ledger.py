"""Managed ledger: a topic partition as an ordered list of segments on bookies.

Metadata (JSON in the metadata store):

* ``/pigeon/ledgers/<domain>/<tenant>/<namespace>/<topic>`` — the ledger: its segments in
  order, each ``{"id", "first_offset", "last_entry_id", "entries", "size", "state",
  "ensemble", "ctime", "last_publish_time"}``; ``state`` is ``open`` while a writer may
  append and ``closed`` (with ``last_entry_id`` fixed) afterwards.  Updated with
  compare-and-set, so two brokers can never both think they own the tail.
* ``/pigeon/segment-ids/s-`` — sequential nodes that hand out unique segment ids.

Writes: ``append_nowait`` assigns the partition offsets and the next entry id at call
time (so the order of calls is the order in the log), hands the entry to the segment
writer, and calls back in order once the replication policy acknowledged it.  The ledger
never re-opens a segment after a restart: it *recovers* the last one (fence + find the
last entry), closes it, and appends to a fresh one (BookKeeper's rule).
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import trio

from pigeon.core import TopicName
from pigeon.core._clock import WallClock
from pigeon.core._entry import pack_entry_header, unpack_entry_header
from pigeon.core.errors import (
    BadVersion,
    EntryNotFound,
    PigeonError,
    ServiceUnavailable,
)

__all__ = ["Entry", "LedgerConfig", "ManagedLedger", "Position", "SegmentInfo"]

log = logging.getLogger(__name__)

# (segment id, entry id). Segment ids grow with every new segment, so positions order as
# the log does, and they stay valid when retention trims segments off the head.
Position = tuple[int, int]
AppendCallback = Callable[[Any, BaseException | None], None]


@dataclass
class LedgerConfig:
    max_entries_per_segment: int = 50_000
    max_segment_bytes: int = 512 * 1024 * 1024
    max_segment_age_s: float = 4 * 3600.0
    cache_max_bytes: int = 256 * 1024 * 1024
    read_batch_bytes: int = 4 * 1024 * 1024


@dataclass
class SegmentInfo:
    id: int
    first_offset: int
    ensemble: list[str]
    state: str = "open"
    last_entry_id: int = -1
    entries: int = 0
    size: int = 0
    ctime: float = 0.0
    last_publish_time: int = 0
    write_quorum: int = 0  # 0: the replication policy's default
    ack_quorum: int = 0
    # Ensemble changes: [first entry id, ensemble] from the second fragment on; entries
    # before the first listed id live on ``initial_ensemble`` (or ``ensemble``).
    fragments: list[list[Any]] = field(default_factory=list)
    initial_ensemble: list[str] = field(default_factory=list)

    def ensemble_for(self, entry_id: int) -> tuple[list[str], int]:
        """(ensemble holding ``entry_id``, first entry id of the next fragment or -1)."""
        current = self.initial_ensemble or self.ensemble
        end = -1
        for first, ensemble in self.fragments:
            if entry_id >= first:
                current = ensemble
            else:
                end = first
                break
        return list(current), end


@dataclass(slots=True)
class Entry:
    segment_id: int
    entry_id: int
    position: Position
    data: bytes | memoryview
    num_messages: int
    first_offset: int
    publish_time: int
    deliver_at: int = 0


SEGMENTS_PATH = "/pigeon/segments"


def segment_path(segment_id: int) -> str:
    """Metadata node of one segment; bookies delete segments whose node is gone."""
    return f"{SEGMENTS_PATH}/{segment_id:016x}"


class _EntryCache:
    """Most recently written entries, bounded by bytes (tail reads never touch bookies)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[int, int], bytes | memoryview] = OrderedDict()

    def put(self, key: tuple[int, int], data: bytes | memoryview) -> None:
        self._entries[key] = data
        self.bytes += len(data)
        while self.bytes > self.max_bytes and self._entries:
            _, old = self._entries.popitem(last=False)
            self.bytes -= len(old)

    def get(self, key: tuple[int, int]) -> bytes | memoryview | None:
        data = self._entries.get(key)
        if data is None:
            self.misses += 1
        else:
            self.hits += 1
        return data


class ManagedLedger:
    """One persistent topic partition."""

    def __init__(
        self,
        topic: TopicName,
        *,
        store: Any,
        policy: Any,
        bookies: Callable[[], list[str]],
        nursery: trio.Nursery,
        config: LedgerConfig | None = None,
        quorum: Callable[[], tuple[int, int, int] | None] | None = None,
        clock: WallClock | None = None,
    ) -> None:
        self.quorum = quorum or (lambda: None)
        self.clock = clock or WallClock()
        self.topic = topic
        self.store = store
        self.policy = policy
        self.bookies = bookies
        self.nursery = nursery
        self.config = config or LedgerConfig()
        self.path = f"/pigeon/ledgers/{topic.path}"
        self.segments: list[SegmentInfo] = []
        self._index: dict[int, int] = {}  # segment id -> index in self.segments
        self._version = -1
        self.next_offset = 0
        self.last_publish_time = 0
        self._writer: Any = None
        self._rolling = False
        self._failed_rolls = 0  # rollovers after a write failure, none acknowledged since
        self._rolled = trio.Event()
        self._rolled.set()
        self._queued: list[tuple[bytes, int, int, AppendCallback]] = []
        self.cache = _EntryCache(self.config.cache_max_bytes)
        self._new_entries = trio.Event()
        self.closed = False
        self.failed: BaseException | None = None
        self.msgs_in = 0
        self.bytes_in = 0
        self.last_trimmed_ensembles: dict[int, list[str]] = {}

    # ------------------------------------------------------------------ metadata

    def _doc(self) -> bytes:
        return json.dumps({"segments": [asdict(s) for s in self.segments]}).encode()

    async def _save(self) -> None:
        """Write the ledger's metadata (compare-and-set).

        Only the owner adds, closes and removes segments; the auditor may change the
        replicas of *closed* segments. A conflict therefore takes the stored replicas of
        closed segments and keeps everything else; a conflict on anything else means
        another broker took the ledger over, and this one gives up.
        """
        for _attempt in range(5):
            try:
                self._version = await self.store.set(self.path, self._doc(), version=self._version)
                return
            except BadVersion:
                stat = await self.store.get(self.path)
                if stat is None:
                    break
                remote = {s["id"]: s for s in json.loads(stat.value).get("segments", [])}
                mine = [s.id for s in self.segments]
                if [i for i in remote if i not in mine and i > (mine[0] if mine else -1)]:
                    break  # segments we do not know: another owner
                for seg in self.segments:
                    other = remote.get(seg.id)
                    if seg.state == "closed" and other is not None:
                        seg.ensemble = list(other["ensemble"])
                        seg.fragments = [list(f) for f in other.get("fragments", [])]
                        seg.initial_ensemble = list(other.get("initial_ensemble", []))
                self._version = stat.version
        raise ServiceUnavailable(
            f"ledger {self.topic} was changed by another broker; giving up ownership"
        )

    def _reindex(self) -> None:
        self._index = {s.id: i for i, s in enumerate(self.segments)}

    async def open(self) -> None:
        stat = await self.store.get(self.path)
        if stat is None:
            try:
                await self.store.create(self.path, self._doc())
                self._version = 0
            except PigeonError:
                stat = await self.store.get(self.path)
        if stat is not None:
            doc = json.loads(stat.value)
            self._version = stat.version
            self.segments = [SegmentInfo(**s) for s in doc.get("segments", [])]
        self._reindex()
        # Recover segments left open by a previous owner (crash): fence, find the end.
        changed = False
        for seg in self.segments:
            if seg.state == "open":
                last = await self._recover(seg)
                seg.last_entry_id = last
                seg.entries = last + 1
                seg.state = "closed"
                changed = True
        # Drop empty closed segments at the tail (nothing to read there).
        while self.segments and self.segments[-1].entries == 0 and len(self.segments) > 0:
            dropped = self.segments.pop()
            log.info("dropping empty segment topic=%s segment=%s", self.topic, dropped.id)
            changed = True
        self._reindex()
        if self.segments:
            last_seg = self.segments[-1]
            entries = await self.policy.read(
                last_seg.id,
                last_seg.ensemble_for(last_seg.last_entry_id)[0],
                last_seg.last_entry_id,
                last_seg.last_entry_id,
                write_quorum=last_seg.write_quorum or None,
            )
            header = unpack_entry_header(entries[0][1])
            self.next_offset = header.first_offset + header.num_messages
            self.last_publish_time = header.publish_time
            if last_seg.size == 0 or last_seg.last_publish_time == 0:
                last_seg.last_publish_time = header.publish_time
        if changed:
            await self._save()
        await self._new_segment()

    async def _recover(self, seg: SegmentInfo) -> int:
        """Fence an open segment and find (and re-replicate) its last entry."""
        return int(
            await self.policy.recover(
                seg.id,
                seg.ensemble,
                ack_quorum=seg.ack_quorum or None,
                write_quorum=seg.write_quorum or None,
                first_entry=seg.fragments[-1][0] if seg.fragments else 0,
            )
        )

    async def _new_segment(self) -> None:
        # Appends queued during a rollover already hold their offsets: the new segment
        # starts at the first of them.
        first_offset = self._queued[0][2] if self._queued else self.next_offset
        bookies = self.bookies()
        quorum = self.quorum()
        ensemble = self.policy.choose_ensemble(bookies, quorum[0] if quorum else None)
        created = await self.store.create("/pigeon/segment-ids/s-", b"", sequential=True)
        segment_id = int(created.rsplit("-", 1)[1]) + 1
        seg = SegmentInfo(
            id=segment_id,
            first_offset=first_offset,
            ensemble=ensemble,
            ctime=time.time(),
            write_quorum=quorum[1] if quorum else 0,
            ack_quorum=quorum[2] if quorum else 0,
        )
        await self.store.create(
            segment_path(segment_id),
            json.dumps(
                {"topic": self.topic.full, "ensemble": ensemble, "ctime": seg.ctime}
            ).encode(),
        )
        self.segments.append(seg)
        self._reindex()
        await self._save()
        self._writer = await self.policy.create_writer(
            segment_id,
            ensemble,
            write_quorum=seg.write_quorum or None,
            ack_quorum=seg.ack_quorum or None,
            replace_bookie=functools.partial(self._replace_bookie, seg),
            nursery=self.nursery,
        )
        log.info("segment opened topic=%s segment=%s ensemble=%s", self.topic, segment_id, ensemble)

    # ------------------------------------------------------------------ writes

    @property
    def last_position(self) -> Position:
        """Position of the last confirmed entry, ``(-1, -1)`` when the ledger is empty."""
        for i in range(len(self.segments) - 1, -1, -1):
            seg = self.segments[i]
            if seg.last_entry_id >= 0:
                return (seg.id, seg.last_entry_id)
        return (-1, -1)

    @property
    def first_offset(self) -> int:
        return self.segments[0].first_offset if self.segments else self.next_offset

    def append_nowait(
        self,
        payload: bytes | memoryview,
        num_messages: int,
        callback: AppendCallback,
        *,
        deliver_at: int = 0,
    ) -> None:
        """Append one batch; ``callback((segment_id, entry_id, first_offset), error)``."""
        if self.closed:
            raise ServiceUnavailable(f"topic {self.topic} is closed")
        if self.failed is not None:
            raise ServiceUnavailable(f"topic {self.topic} failed: {self.failed}")
        offset = self.next_offset
        self.next_offset += num_messages
        now = max(self.clock.now_ms(), self.last_publish_time)
        self.last_publish_time = now
        data = pack_entry_header(num_messages, offset, now, deliver_at) + bytes(payload)
        if self._rolling or self._writer is None:
            self._queued.append((data, num_messages, offset, callback))
            return
        self._write(data, num_messages, offset, callback)

    def _write(self, data: bytes, n: int, offset: int, callback: AppendCallback) -> None:
        seg_index = len(self.segments) - 1
        seg = self.segments[seg_index]
        writer = self._writer

        def done(entry_id: int, error: BaseException | None) -> None:
            if error is not None:
                callback(None, error)
                self._on_writer_failed(writer, error)
                return
            self._failed_rolls = 0
            seg.last_entry_id = entry_id
            seg.entries = entry_id + 1
            seg.size += len(data)
            seg.last_publish_time = self.last_publish_time
            self.cache.put((seg.id, entry_id), data)
            self.msgs_in += n
            self.bytes_in += len(data)
            callback((seg.id, entry_id, offset), None)
            self._new_entries.set()

        try:
            writer.add_nowait(data, done)
        except PigeonError as exc:
            callback(None, exc)
            self._on_writer_failed(writer, exc)
            return
        if (
            writer.next_entry_id >= self.config.max_entries_per_segment
            or writer.bytes_written >= self.config.max_segment_bytes
            or time.time() - seg.ctime >= self.config.max_segment_age_s
        ):
            self._start_roll()

    async def _replace_bookie(self, seg: SegmentInfo, index: int, first_entry: int) -> str:
        """Ensemble change: a new bookie (the least loaded outside the ensemble) for
        ``index`` from ``first_entry`` on, recorded in the segment's metadata."""
        candidates = [b for b in self.bookies() if b not in seg.ensemble]
        if not candidates:
            raise ServiceUnavailable(
                f"no spare bookie to replace {seg.ensemble[index]} in segment {seg.id}"
            )
        load = getattr(self.bookies, "load", None)  # the BookieDirectory's bytes/s
        address = min(candidates, key=lambda b: (load(b), b)) if load else candidates[0]
        if not seg.initial_ensemble:
            seg.initial_ensemble = list(seg.ensemble)
        ensemble = list(seg.ensemble)
        ensemble[index] = address
        seg.ensemble = ensemble
        seg.fragments = [f for f in seg.fragments if f[0] != first_entry]
        seg.fragments.append([first_entry, ensemble])
        await self._save()
        return address

    def _on_writer_failed(self, writer: Any, error: BaseException) -> None:
        if writer is self._writer and not self._rolling:
            log.warning("segment write failed topic=%s error=%s; rolling over", self.topic, error)
            self._start_roll(recover=True)

    def _start_roll(self, *, recover: bool = False) -> None:
        if self._rolling:
            return
        self._rolling = True
        self._rolled = trio.Event()
        self.nursery.start_soon(self._roll, recover)

    async def _roll(self, recover: bool) -> None:
        writer = self._writer
        seg = self.segments[-1]
        try:
            if recover:
                # a writer failing again and again (bookies refusing every add) must not
                # spin through new segments: back off, 50 ms doubling up to 5 s
                if self._failed_rolls:
                    await trio.sleep(min(5.0, 0.05 * 2 ** (self._failed_rolls - 1)))
                self._failed_rolls += 1
                seg.last_entry_id = await self._recover(seg)
                seg.entries = seg.last_entry_id + 1
            else:
                with trio.fail_after(30):
                    await writer.wait_idle()
                if writer.failed is not None:
                    seg.last_entry_id = await self._recover(seg)
                    seg.entries = seg.last_entry_id + 1
            seg.state = "closed"
            writer.close()
            if seg.entries == 0:
                self.segments.pop()
                self._reindex()
            await self._save()
            await self._new_segment()
        except BaseException as exc:
            self.failed = exc if isinstance(exc, Exception) else ServiceUnavailable("cancelled")
            queued, self._queued = self._queued, []
            for _data, _n, _off, cb in queued:
                cb(None, ServiceUnavailable(f"topic {self.topic} cannot roll over: {exc}"))
            if not isinstance(exc, Exception):
                raise
            log.error("segment rollover failed topic=%s error=%s", self.topic, exc)  # noqa: TRY400 - the cause is in the message
            return
        finally:
            self._rolling = False
            self._rolled.set()
        queued, self._queued = self._queued, []
        for data, n, offset, cb in queued:
            self._write(data, n, offset, cb)

    async def close(self) -> None:
        """Wait for in-flight writes and close the last segment in metadata."""
        if self.closed:
            return
        self.closed = True
        with trio.move_on_after(10):
            await self._rolled.wait()
            if self._writer is not None:
                await self._writer.wait_idle()
        if self.segments and self.segments[-1].state == "open":
            seg = self.segments[-1]
            seg.state = "closed"
            if seg.entries == 0:
                self.segments.pop()
                self._reindex()
            try:
                await self._save()
            except PigeonError as exc:
                log.warning("closing ledger failed topic=%s error=%s", self.topic, exc)
        self._new_entries.set()

    # ------------------------------------------------------------------ retention

    def _segment_end(self, index: int) -> int:
        """One past the last offset of segment ``index``."""
        if index + 1 < len(self.segments):
            return self.segments[index + 1].first_offset
        return self.next_offset

    def bytes_after(self, offset: int) -> int:
        """Stored bytes from ``offset`` on (whole segments, pro rata inside one)."""
        total = 0
        for i, seg in enumerate(self.segments):
            end = self._segment_end(i)
            if end <= offset:
                continue
            count = end - seg.first_offset
            if offset <= seg.first_offset or count <= 0:
                total += seg.size
            else:
                total += seg.size * (end - offset) // count
        return total

    def offset_keeping_bytes(self, limit: int) -> int:
        """The offset from which on about ``limit`` bytes are stored (pro rata in a segment)."""
        kept = 0
        for i in range(len(self.segments) - 1, -1, -1):
            seg = self.segments[i]
            end = self._segment_end(i)
            if kept + seg.size > limit:
                count = end - seg.first_offset
                if seg.size <= 0 or count <= 0:
                    return end
                keep_msgs = (limit - kept) * count // seg.size
                return end - keep_msgs
            kept += seg.size
        return self.first_offset

    async def trim(
        self, consumed: int, retention_time_s: float, retention_size_mb: float, now_ms: int
    ) -> list[int]:
        """Drop closed head segments every subscription is past, beyond retention.

        A consumed segment is kept while it is within *both* retention limits (-1 means
        unlimited); it goes as soon as it exceeds either. Returns the trimmed ids.
        """
        consumed_segments = []
        for i, seg in enumerate(self.segments[:-1]):  # never the segment being written
            if seg.state != "closed" or self._segment_end(i) > consumed:
                break
            consumed_segments.append(seg)
        retained = sum(s.size for s in consumed_segments)
        trimmed: list[SegmentInfo] = []
        for seg in consumed_segments:
            too_old = retention_time_s != -1 and (
                now_ms - seg.last_publish_time > retention_time_s * 1000
            )
            too_big = retention_size_mb != -1 and retained > retention_size_mb * 1024 * 1024
            if not (too_old or too_big):
                break
            trimmed.append(seg)
            retained -= seg.size
        if not trimmed:
            return []
        del self.segments[: len(trimmed)]
        self._reindex()
        await self._save()
        self.last_trimmed_ensembles = {s.id: list(s.ensemble) for s in trimmed}
        log.info("trimmed topic=%s segments=%s", self.topic, [s.id for s in trimmed])
        return [s.id for s in trimmed]

    # ------------------------------------------------------------------ reads

    def new_entries_event(self) -> trio.Event:
        if self._new_entries.is_set():
            self._new_entries = trio.Event()
        return self._new_entries

    def normalize(self, pos: Position) -> Position | None:
        """The position itself or the first one after it that exists; None past the end."""
        seg_id, entry = pos
        index = self._index.get(seg_id)
        if index is None:
            # trimmed (or never existed): continue at the first segment after it
            ids = [s.id for s in self.segments]
            index = bisect.bisect_right(ids, seg_id)
            entry = 0
        while index < len(self.segments):
            seg = self.segments[index]
            if entry <= seg.last_entry_id:
                return (seg.id, entry)
            if seg.state == "open":
                return None
            index += 1
            entry = 0
        return None

    def next_position(self, pos: Position) -> Position:
        return (pos[0], pos[1] + 1)

    def start_position(self) -> Position:
        return (self.segments[0].id, 0) if self.segments else (0, 0)

    def end_position(self) -> Position:
        """The position the next appended entry will get."""
        if not self.segments:
            return (0, 0)
        seg = self.segments[-1]
        return (seg.id, seg.last_entry_id + 1)

    async def read(
        self, pos: Position, *, max_entries: int = 100, max_bytes: int | None = None
    ) -> list[Entry]:
        """Confirmed entries from ``pos`` on, within one segment; [] at the end."""
        max_bytes = max_bytes or self.config.read_batch_bytes
        npos = self.normalize(pos)
        if npos is None:
            return []
        seg_id, entry_id = npos
        index = self._index[seg_id]
        seg = self.segments[index]
        last = min(seg.last_entry_id, entry_id + max_entries - 1)
        out: list[Entry] = []
        total = 0
        eid = entry_id
        while eid <= last and total < max_bytes:
            data = self.cache.get((seg.id, eid))
            if data is None:
                break
            out.append(self._entry(seg, eid, data))
            total += len(data)
            eid += 1
        if not out:
            ensemble, fragment_end = seg.ensemble_for(entry_id)
            if fragment_end >= 0:
                last = min(last, fragment_end - 1)
            raw = await self.policy.read(
                seg.id,
                ensemble,
                entry_id,
                last,
                max_bytes=max_bytes,
                max_count=max_entries,
                write_quorum=seg.write_quorum or None,
            )
            if not raw:
                raise EntryNotFound(f"segment {seg.id} entry {entry_id} is missing")
            for eid2, data in raw:
                out.append(self._entry(seg, eid2, data))
        return out

    def _entry(self, seg: SegmentInfo, entry_id: int, data: bytes | memoryview) -> Entry:
        header = unpack_entry_header(data)
        return Entry(
            seg.id,
            entry_id,
            (seg.id, entry_id),
            data,
            header.num_messages,
            header.first_offset,
            header.publish_time,
            header.deliver_at,
        )

    async def read_one(self, pos: Position) -> Entry:
        entries = await self.read(pos, max_entries=1)
        if not entries or entries[0].position != pos:
            raise EntryNotFound(f"no entry at {pos}")
        return entries[0]

    def index_of_segment(self, segment_id: int) -> int | None:
        return self._index.get(segment_id)

    async def position_for_offset(self, offset: int) -> Position:
        """Position of the entry holding ``offset`` (the end position if past the end)."""
        if not self.segments or offset >= self.next_offset:
            return self.end_position()
        firsts = [s.first_offset for s in self.segments]
        index = max(bisect.bisect_right(firsts, offset) - 1, 0)
        seg = self.segments[index]
        if seg.last_entry_id < 0 or offset < seg.first_offset:
            return (seg.id, 0)
        lo, hi = 0, seg.last_entry_id
        while lo < hi:  # last entry whose first offset <= offset
            mid = (lo + hi + 1) // 2
            entry = await self.read_one((seg.id, mid))
            if entry.first_offset <= offset:
                lo = mid
            else:
                hi = mid - 1
        return (seg.id, lo)

    async def position_for_time(self, timestamp_ms: int) -> Position:
        """First entry published at or after ``timestamp_ms``."""
        for seg in self.segments:
            if seg.last_entry_id < 0 or seg.last_publish_time < timestamp_ms:
                continue
            lo, hi = 0, seg.last_entry_id
            while lo < hi:
                mid = (lo + hi) // 2
                entry = await self.read_one((seg.id, mid))
                if entry.publish_time >= timestamp_ms:
                    hi = mid
                else:
                    lo = mid + 1
            return (seg.id, lo)
        return self.end_position()
