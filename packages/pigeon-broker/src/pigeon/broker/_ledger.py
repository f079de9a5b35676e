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
import contextlib
import functools
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import trio

from pigeon.broker._cursor import RangeSet
from pigeon.broker._histogram import LatencyHistogram
from pigeon.core import ReplicationPolicy, SegmentWriter, TopicName
from pigeon.core.batch import pack_entry_header, unpack_entry_header
from pigeon.core.errors import (
    BadVersion,
    CorruptEntry,
    EntryNotFound,
    NotEnoughBookies,
    NotOwner,
    PigeonError,
    SegmentNotFound,
    ServiceUnavailable,
)
from pigeon.core.paths import SEGMENT_ID_PREFIX, cursors_path, ledger_path, segment_path
from pigeon.core.runtime import WallClock

__all__ = ["DamagedRun", "Entry", "LedgerConfig", "ManagedLedger", "Position", "SegmentInfo"]

log = logging.getLogger(__name__)

# (segment id, entry id). Segment ids grow with every new segment, so positions order as
# the log does, and they stay valid when retention trims segments off the head.
Position = tuple[int, int]
AppendCallback = Callable[[Any, BaseException | None], None]

#: a bookie that failed a write is left out of new ensembles for this long (seconds)
QUARANTINE_S = 5.0
#: how long opening a segment writer on its ensemble may take
WRITER_OPEN_TIMEOUT_S = 5.0
#: how long a size/age rollover waits for in-flight entries before recovering instead
SEGMENT_DRAIN_S = 30.0
#: first and longest wait between rollover attempts
ROLL_BACKOFF_S = (0.05, 2.0)
#: damaged entries read one by one looking for the end of a damaged run, before the
#: search gallops (a run that long is a whole damaged region)
DAMAGE_PROBES = 4096
#: entries a binary search (seek by offset or time) reads past a damaged one
NEAR_PROBES = 64
#: the errors with which a policy says no replica holds an entry intact
_UNREADABLE = (CorruptEntry, EntryNotFound, SegmentNotFound)
#: failed attempts to open a new segment before pending appends fail (retriably)
ROLL_ATTEMPTS_BEFORE_FAILING = 4
#: ... or seconds a rollover has been failing (attempts that wait on paused bookies)
ROLL_FAILING_S = 10.0


@dataclass(slots=True, eq=False)
class _Append:
    """One appended batch until it is settled: stored (callback with its position) or
    failed (callback with a retriable error).  ``segment_id``/``entry_id`` say where it
    was last handed to a writer (-1: in no segment yet)."""

    data: bytes
    num_messages: int
    offset: int
    callback: AppendCallback
    accepted: float = 0.0  # time.perf_counter() when the broker accepted it
    segment_id: int = -1
    entry_id: int = -1


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


@dataclass(frozen=True, slots=True)
class DamagedRun:
    """Entries ``first_entry..last_entry`` of a segment that no replica holds intact
    (bit rot, a truncated or lost data file): see :meth:`ManagedLedger.skip_damaged`."""

    segment_id: int
    first_entry: int
    last_entry: int
    #: where reading goes on after the run
    next: Position
    #: first offset of what follows the run: the run's messages end before it
    end_offset: int

    @property
    def entries(self) -> int:
        return self.last_entry - self.first_entry + 1


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
        policy: ReplicationPolicy,
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
        self.path = ledger_path(topic)
        self.segments: list[SegmentInfo] = []
        self._index: dict[int, int] = {}  # segment id -> index in self.segments
        # every segment id this ledger has had (a remote one outside it is another owner's)
        self._known: set[int] = set()
        self._version = -1
        self.next_offset = 0
        self.last_publish_time = 0
        self._writer: SegmentWriter | None = None
        self._rolling = False
        self._rolled = trio.Event()
        self._rolled.set()
        # Appended and not yet settled, in offset order (see "Writes" in the module doc).
        self._pending: deque[_Append] = deque()
        # Set while no segment can be written (too few bookies): appends are refused at
        # once with this retriable error, and a background rollover keeps trying.
        self.unavailable: PigeonError | None = None
        self._quarantine: dict[str, float] = {}  # bookie -> until (trio time)
        self.on_fenced: Callable[[], None] | None = None
        self.cache = _EntryCache(self.config.cache_max_bytes)
        self._new_entries = trio.Event()
        self.closed = False
        self.msgs_in = 0
        self.bytes_in = 0
        #: accepted-to-stored time of every stored append (exported at /metrics)
        self.publish_latency = LatencyHistogram()
        self.last_trimmed_ensembles: dict[int, list[str]] = {}
        # Entries no replica holds intact (found by reads and at open), per segment id,
        # and the runs they form: see "Damaged entries" in skip_damaged.
        self._damaged: dict[int, RangeSet] = {}
        self._damaged_runs: list[DamagedRun] = []

    # ------------------------------------------------------------------ metadata

    def _doc(self) -> bytes:
        # next_offset: where the offsets went up to, should the end of the log be found
        # damaged when the ledger is opened again (see _open_tail)
        return json.dumps(
            {"segments": [asdict(s) for s in self.segments], "next_offset": self.next_offset}
        ).encode()

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
                if [i for i in remote if i not in self._known]:
                    break  # segments we never had: another owner's
                if any(
                    remote[s.id]["state"] == "closed"
                    and (s.state != "closed" or remote[s.id]["last_entry_id"] != s.last_entry_id)
                    for s in self.segments
                    if s.id in remote
                ):
                    break  # a segment we write (or closed) was closed by someone else
                for seg in self.segments:
                    other = remote.get(seg.id)
                    if seg.state == "closed" and other is not None:
                        seg.ensemble = list(other["ensemble"])
                        seg.fragments = [list(f) for f in other.get("fragments", [])]
                        seg.initial_ensemble = list(other.get("initial_ensemble", []))
                self._version = stat.version
        raise NotOwner(f"ledger {self.topic} was changed by another broker; giving up ownership")

    def _reindex(self) -> None:
        self._index = {s.id: i for i, s in enumerate(self.segments)}
        self._known.update(self._index)

    async def open(self) -> None:
        stat = await self.store.get(self.path)
        if stat is None:
            try:
                await self.store.create(self.path, self._doc())
                self._version = 0
            except PigeonError:
                stat = await self.store.get(self.path)
        recorded_offset = 0
        if stat is not None:
            doc = json.loads(stat.value)
            self._version = stat.version
            self.segments = [SegmentInfo(**s) for s in doc.get("segments", [])]
            recorded_offset = int(doc.get("next_offset", 0))
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
        recovered = changed
        # Drop empty closed segments at the tail (nothing to read there); offsets go on
        # from where they started.
        floor, dropped = 0, []
        while self.segments and self.segments[-1].entries == 0:
            seg = self.segments.pop()
            floor = max(floor, seg.first_offset)
            dropped.append(seg.id)
            log.info("dropping empty segment topic=%s segment=%s", self.topic, seg.id)
            changed = True
        self._reindex()
        if self.segments:
            await self._open_tail(recorded_offset, check_cursors=recovered)
        elif dropped or stat is not None:
            # nothing left to read (all trimmed): offsets go on where they stopped (the
            # dropped segment's start, the recorded end) and above every cursor
            self.next_offset = max(floor, recorded_offset, await self._cursor_offsets())
        self.next_offset = max(self.next_offset, floor)
        if changed:
            await self._save()
        for segment_id in dropped:
            # out of the ledger: its node goes too, so the bookies' GC removes its files
            with contextlib.suppress(PigeonError):
                await self.store.delete(segment_path(segment_id))
        try:
            await self._new_segment()
        except PigeonError as exc:
            if not exc.retriable:
                raise
            # readable now, writable once bookies are back: keep trying in the background
            self.unavailable = exc
            log.warning("topic not writable topic=%s error=%s", self.topic, exc)
            self._start_roll()

    async def _open_tail(self, recorded_offset: int, *, check_cursors: bool = False) -> None:
        """``next_offset`` and ``last_publish_time`` from the last entry of the log.

        When no replica holds the last entries intact (a data file truncated or damaged
        while the broker was down), the ledger opens anyway: the entries that can be read
        stay readable, the missing ones form a damaged run (reported, counted, skipped by
        subscriptions per their policy), and offsets go on above every offset that may
        have been handed out: the highest of the end of the last readable entry, the
        ``next_offset`` recorded in the metadata and every cursor's position.
        ``check_cursors`` (after a crash): offsets go on above every cursor even when the
        end of the log reads fine (a single copy cut short loses entries unseen).
        """
        seg = self.segments[-1]
        last = seg.last_entry_id
        error: PigeonError | None = None
        try:
            entry: Entry | None = await self.read_one((seg.id, last))
        except CorruptEntry as exc:
            entry, error = None, exc
        if entry is None:
            entry = await self._last_readable(seg)
            readable_end = entry.first_offset + entry.num_messages if entry else seg.first_offset
            cursors = await self._cursor_offsets()
            self.next_offset = max(readable_end, recorded_offset, cursors)
            first_lost = entry.entry_id + 1 if entry is not None else 0
            run = DamagedRun(seg.id, first_lost, last, (seg.id, last + 1), self.next_offset)
            self._record_damage(run)
            log.error(
                "ledger tail damaged topic=%s segment=%s entries=%s..%s (%s) are on no replica"
                " intact; opening with next_offset=%s (readable_end=%s recorded=%s"
                " cursors=%s): %s",
                self.topic,
                seg.id,
                first_lost,
                last,
                run.entries,
                self.next_offset,
                readable_end,
                recorded_offset,
                cursors,
                error,
            )
        else:
            self.next_offset = entry.first_offset + entry.num_messages
            if check_cursors:
                cursors = await self._cursor_offsets()
                if cursors > self.next_offset:
                    log.error(
                        "cursors ahead of the log topic=%s segment=%s end_offset=%s"
                        " cursors=%s: acknowledged entries were lost; offsets go on from %s",
                        self.topic,
                        seg.id,
                        self.next_offset,
                        cursors,
                        cursors,
                    )
                    self.next_offset = cursors
        if entry is not None:
            self.last_publish_time = entry.publish_time
            if seg.size == 0 or seg.last_publish_time == 0:
                seg.last_publish_time = entry.publish_time

    async def _last_readable(self, seg: SegmentInfo) -> Entry | None:
        """The last entry of ``seg`` some replica holds intact (None: no entry is)."""
        top = seg.last_entry_id
        stored = getattr(self.policy, "stored_last_entry", None)
        if stored is not None and seg.ensemble_for(top)[1] < 0:
            ensemble = seg.ensemble_for(top)[0]
            top = min(top, int(await stored(seg.id, ensemble)))
        k, step, probes = top, 1, 0
        while k >= 0:
            try:
                return await self.read_one((seg.id, k))
            except CorruptEntry:
                pass
            probes += 1
            if probes > NEAR_PROBES:
                step *= 2  # a long damaged stretch: gallop back
            k -= step
        return None

    async def _cursor_offsets(self) -> int:
        """The highest offset any stored cursor of the topic has acknowledged (0: none)."""
        root = cursors_path(self.topic)
        top = 0
        children = getattr(self.store, "children", None)
        if children is None:  # a store without listings (tests): no cursor to honour
            return top
        try:
            for name in await children(root):
                stat = await self.store.get(f"{root}/{name}")
                if stat is None:
                    continue
                doc = json.loads(stat.value)
                top = max(top, int(doc.get("mark_delete", 0)))
                top = max([top, *(int(end) for _start, end in doc.get("acked", []))])
        except (PigeonError, ValueError, TypeError, KeyError) as exc:
            log.warning("cannot read cursors topic=%s error=%s", self.topic, exc)
        return top

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

    def _ensemble_config(self) -> tuple[list[str], int, int, int]:
        """(bookies to choose from, E, Qw, Qa) for a new segment.

        Bookies that failed a write recently (quarantined for ``QUARANTINE_S``) are left
        out.  With fewer writable bookies than E, the segment gets an ensemble of those there
        are (E and Qw shrink, never below Qa): writes go on while redundancy remains, and
        the full ensemble returns with the next segment once the bookies are back.
        """
        quorum = self.quorum()
        e, qw, qa = quorum or (
            self.policy.ensemble_size,
            self.policy.write_quorum,
            self.policy.ack_quorum,
        )
        now = trio.current_time()
        self._quarantine = {b: t for b, t in self._quarantine.items() if t > now}
        registered = list(self.bookies())
        healthy = [b for b in registered if b not in self._quarantine]
        if len(healthy) < qa:
            raise NotEnoughBookies(
                f"topic {self.topic} needs {qa} writable bookies (ack quorum), "
                f"{len(healthy)} available"
            )
        e = min(e, len(healthy))
        return healthy, e, min(qw, e), qa

    def quarantine(self, address: str, seconds: float = QUARANTINE_S) -> None:
        """Leave ``address`` out of new ensembles for a while (it failed a write)."""
        self._quarantine[address] = trio.current_time() + seconds

    async def _new_segment(self) -> None:
        bookies, e, qw, qa = self._ensemble_config()
        ensemble = self.policy.choose_ensemble(bookies, e)
        first_offset = self._pending[0].offset if self._pending else self.next_offset
        created = await self.store.create(SEGMENT_ID_PREFIX, b"", sequential=True)
        segment_id = int(created.rsplit("-", 1)[1]) + 1
        seg = SegmentInfo(
            id=segment_id,
            first_offset=first_offset,
            ensemble=ensemble,
            ctime=time.time(),
            write_quorum=qw,
            ack_quorum=qa,
        )
        await self.store.create(
            segment_path(segment_id),
            json.dumps(
                {"topic": self.topic.full, "ensemble": ensemble, "ctime": seg.ctime}
            ).encode(),
        )
        try:
            with trio.fail_after(WRITER_OPEN_TIMEOUT_S):
                writer = await self.policy.create_writer(
                    segment_id,
                    ensemble,
                    write_quorum=qw,
                    ack_quorum=qa,
                    replace_bookie=functools.partial(self._replace_bookie, seg),
                    nursery=self.nursery,
                )
        except (PigeonError, OSError, trio.TooSlowError) as exc:
            # A registered bookie that does not answer (dead, paused, cut off): leave it
            # out of the next try; the segment id is simply never used.
            for address in ensemble:
                if not await self._reachable(address):
                    self.quarantine(address)
            with contextlib.suppress(PigeonError):
                await self.store.delete(segment_path(segment_id))
            raise ServiceUnavailable(
                f"cannot open a segment of {self.topic} on {ensemble}: {exc}"
            ) from None
        if self.closed:  # closed while the writer was being opened
            writer.close()
            with contextlib.suppress(PigeonError):
                await self.store.delete(segment_path(segment_id))
            raise ServiceUnavailable(f"topic {self.topic} is closed")
        self.segments.append(seg)
        self._reindex()
        try:
            await self._save()
        except BaseException:
            self.segments.pop()
            self._reindex()
            writer.close()
            raise
        self._writer = writer
        log.info(
            "segment opened topic=%s segment=%s ensemble=%s write_quorum=%s ack_quorum=%s",
            self.topic,
            segment_id,
            ensemble,
            qw,
            qa,
        )

    async def _reachable(self, address: str) -> bool:
        client = getattr(self.policy, "client", None)
        if client is None:
            return True
        try:
            with trio.fail_after(1.0):
                await client.connection(address)
        except (PigeonError, OSError, trio.TooSlowError):
            return False
        return True

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
        """Append one batch; ``callback((segment_id, entry_id, first_offset), error)``.

        Raises (and stores nothing) when the ledger is closed or cannot write now; else
        the callback runs exactly once, in append order: with the entry's position once
        it is stored on the ack quorum, or with a retriable error when it was not stored
        (then every later pending append fails too, and their offsets are reused).
        """
        if self.closed:
            raise ServiceUnavailable(f"topic {self.topic} is closed")
        if self.unavailable is not None:
            raise self.unavailable
        offset = self.next_offset
        self.next_offset += num_messages
        now = max(self.clock.now_ms(), self.last_publish_time)
        self.last_publish_time = now
        # One copy: the tail cache serves the entry whole; the writer sends this object.
        data = pack_entry_header(num_messages, offset, now, deliver_at) + payload
        append = _Append(data, num_messages, offset, callback, time.perf_counter())
        self._pending.append(append)
        if not self._rolling and self._writer is not None:
            self._write(append)

    def _write(self, append: _Append) -> None:
        seg = self.segments[-1]
        writer = self._writer
        assert writer is not None  # appends are written only while a segment is open

        def done(entry_id: int, error: BaseException | None) -> None:
            if error is not None:
                self._on_writer_failed(writer, error)
            else:
                self._stored(seg, append, entry_id)

        try:
            entry_id = writer.add_nowait(append.data, done)
        except PigeonError as exc:
            self._on_writer_failed(writer, exc)
            return
        append.segment_id = seg.id
        append.entry_id = entry_id
        if (
            writer.next_entry_id >= self.config.max_entries_per_segment
            or writer.bytes_written >= self.config.max_segment_bytes
            or time.time() - seg.ctime >= self.config.max_segment_age_s
        ):
            self._start_roll()

    def _stored(self, seg: SegmentInfo, append: _Append, entry_id: int) -> None:
        """``append`` is stored as ``entry_id`` of ``seg``: settle it (in order)."""
        if not self._pending or self._pending[0] is not append:
            log.error(
                "out-of-order write completion topic=%s segment=%s entry=%s",
                self.topic,
                seg.id,
                entry_id,
            )
            return
        self._pending.popleft()
        seg.last_entry_id = max(seg.last_entry_id, entry_id)
        seg.entries = seg.last_entry_id + 1
        seg.size += len(append.data)
        seg.last_publish_time = max(seg.last_publish_time, self.last_publish_time)
        self.cache.put((seg.id, entry_id), append.data)
        self.msgs_in += append.num_messages
        self.bytes_in += len(append.data)
        self.publish_latency.observe(time.perf_counter() - append.accepted)
        try:
            append.callback((seg.id, entry_id, append.offset), None)
        except Exception:
            log.exception("append callback failed topic=%s", self.topic)
        self._new_entries.set()

    def _fail_pending(self, error: PigeonError) -> None:
        """Fail every pending append that is in no segment (a suffix), reusing offsets."""
        failed: list[_Append] = []
        while self._pending and self._pending[-1].segment_id < 0:
            failed.append(self._pending.pop())
        if not failed:
            return
        self.next_offset = failed[-1].offset
        for append in reversed(failed):
            try:
                append.callback(None, error)
            except Exception:
                log.exception("append callback failed topic=%s", self.topic)

    async def _replace_bookie(self, seg: SegmentInfo, index: int, first_entry: int) -> str:
        """Ensemble change: a new bookie (the least loaded outside the ensemble) for
        ``index`` from ``first_entry`` on, recorded in the segment's metadata."""
        writer = self._writer
        if seg.state != "open" or self.closed or (writer is not None and writer.failed is not None):
            # a change still under way when the segment's writer failed (the segment is
            # being recovered on its ensemble) or the segment was closed: its entries
            # are on the old bookies, and so they stay in its metadata
            raise ServiceUnavailable(f"segment {seg.id} is closed: no ensemble change")
        self.quarantine(seg.ensemble[index])
        candidates = [
            b for b in self.bookies() if b not in seg.ensemble and b not in self._quarantine
        ]
        if not candidates:
            raise ServiceUnavailable(
                f"no spare bookie to replace {seg.ensemble[index]} in segment {seg.id}"
            )
        load = getattr(self.bookies, "load", None)  # the BookieDirectory's bytes/s
        address = min(candidates, key=lambda b: (load(b), b)) if load else candidates[0]
        before = (seg.ensemble, seg.fragments, seg.initial_ensemble)
        if not seg.initial_ensemble:
            seg.initial_ensemble = list(seg.ensemble)
        ensemble = list(seg.ensemble)
        ensemble[index] = address
        seg.ensemble = ensemble
        seg.fragments = [f for f in seg.fragments if f[0] != first_entry]
        seg.fragments.append([first_entry, ensemble])
        try:
            await self._save()
        except BaseException:
            # not recorded: the writer keeps the old bookie at ``index`` and tries again
            seg.ensemble, seg.fragments, seg.initial_ensemble = before
            raise
        return address

    def _on_writer_failed(self, writer: SegmentWriter, error: BaseException) -> None:
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
        """Close the current segment and open the next one, until it works.

        Entries the old writer did not confirm are settled by recovering the segment
        (fence it, find its last entry): those at or before the end are stored; the
        rest are written again, with the same offsets, to the new segment.  Failures
        (bookies or metadata away) are retried with backoff for as long as the ledger
        is open; while no segment can be made, pending appends fail with a retriable
        error and new ones are refused, until a segment can be made again.
        """
        delay = ROLL_BACKOFF_S[0]
        attempts = 0
        started = trio.current_time()
        try:
            while not self.closed:
                attempts += 1
                try:
                    if self._writer is not None:
                        await self._close_segment(recover)
                    if self.closed:
                        break  # closed meanwhile: no new segment (close() gave up waiting)
                    await self._new_segment()
                    break
                except NotOwner:
                    raise
                except (PigeonError, OSError) as exc:
                    log.warning(
                        "segment rollover failed topic=%s error=%s; retrying in %.2fs",
                        self.topic,
                        exc,
                        delay,
                    )
                    # Also (after twice the attempts, or ROLL_FAILING_S) while the old
                    # segment cannot be closed, e.g. not recovered with too few bookies:
                    # its own appends wait for its recovery, those in no segment fail.
                    if (
                        self._writer is None
                        and (
                            isinstance(exc, NotEnoughBookies)
                            or attempts >= ROLL_ATTEMPTS_BEFORE_FAILING
                        )
                    ) or (
                        attempts >= 2 * ROLL_ATTEMPTS_BEFORE_FAILING
                        or trio.current_time() - started >= ROLL_FAILING_S
                    ):
                        error = (
                            exc
                            if isinstance(exc, PigeonError) and exc.retriable
                            else ServiceUnavailable(f"topic {self.topic} cannot write: {exc}")
                        )
                        self.unavailable = error
                        self._fail_pending(error)
                    await trio.sleep(delay)
                    delay = min(delay * 2, ROLL_BACKOFF_S[1])
        except NotOwner as exc:
            self._fenced(exc)
            return
        except BaseException:
            self._fenced(ServiceUnavailable(f"topic {self.topic} is closing"), notify=False)
            raise
        finally:
            self._rolling = False
            self._rolled.set()
        if self.closed:
            return
        if self.unavailable is not None:
            log.info("topic writable again topic=%s", self.topic)
            self.unavailable = None
        for append in list(self._pending):
            if append.segment_id < 0:
                self._write(append)
                if self._rolling:
                    break  # the new segment is full or failed already; the next roll goes on

    async def _close_segment(self, recover: bool) -> None:
        """Stop the writer, find the segment's true end, settle what it holds, close it."""
        writer = self._writer
        assert writer is not None  # called only while a segment is open
        seg = self.segments[-1]
        if not recover:
            with trio.move_on_after(SEGMENT_DRAIN_S):
                await writer.wait_idle()
        if recover or writer.failed is not None or writer.pending:
            if writer.failed is None:
                writer.abort(ServiceUnavailable(f"segment {seg.id} is being recovered"))
            last = await self._recover(seg)
            if last < seg.last_entry_id:
                # copies lost since they were acknowledged: the segment still ends after
                # them (reads report them damaged), never below what producers were told
                log.error(
                    "recovery found fewer entries than were acknowledged topic=%s segment=%s"
                    " recovered_last=%s acknowledged_last=%s",
                    self.topic,
                    seg.id,
                    last,
                    seg.last_entry_id,
                )
                last = seg.last_entry_id
        else:
            last = writer.lac
        writer.close()
        seg.state = "closed"
        old_last, old_size = seg.last_entry_id, seg.size
        seg.last_entry_id = last
        seg.entries = last + 1
        stored = [a for a in self._pending if a.segment_id == seg.id and a.entry_id <= last]
        seg.size += sum(len(a.data) for a in stored)
        emptied = seg.entries == 0
        if emptied:
            self.segments.pop()
            self._reindex()
        try:
            await self._save()
        except BaseException:
            if emptied:
                self.segments.append(seg)
                self._reindex()
            seg.state, seg.last_entry_id, seg.size = "open", old_last, old_size
            seg.entries = old_last + 1
            raise
        self._writer = None
        # Settled by the recovery: stored at or before the end; the rest goes again.
        for append in list(self._pending):
            if append.segment_id != seg.id:
                continue
            if append.entry_id <= last:
                self._stored_recovered(seg, append)
            else:
                append.segment_id = append.entry_id = -1

    def _stored_recovered(self, seg: SegmentInfo, append: _Append) -> None:
        seg.size -= len(append.data)  # counted when the segment was closed
        last, entries = seg.last_entry_id, seg.entries
        self._stored(seg, append, append.entry_id)
        seg.last_entry_id, seg.entries = last, entries

    def _fenced(self, error: PigeonError, *, notify: bool = True) -> None:
        """Another broker took the ledger over (or it is closing): fail what is pending."""
        self.closed = True
        pending, self._pending = list(self._pending), deque()
        for append in pending:
            try:
                append.callback(None, error)
            except Exception:
                log.exception("append callback failed topic=%s", self.topic)
        if self._writer is not None:
            self._writer.close()
        log.warning("ledger closed topic=%s error=%s", self.topic, error)
        if notify and self.on_fenced is not None:
            self.on_fenced()

    async def close(self) -> None:
        """Wait (bounded) for in-flight writes, then close the last segment.

        When writes do not drain in time, the segment stays open in the metadata: the
        next owner recovers it, and the pending appends fail with a retriable error
        (stored or not, the client's resend is answered by de-duplication).
        """
        if self.closed:
            return
        self.closed = True
        with trio.move_on_after(10):
            await self._rolled.wait()
            if self._writer is not None:
                await self._writer.wait_idle()
        writer = self._writer
        drained = writer is not None and writer.failed is None and not writer.pending
        if self.segments and self.segments[-1].state == "open" and drained:
            seg = self.segments[-1]
            seg.state = "closed"
            if seg.entries == 0:
                self.segments.pop()
                self._reindex()
            try:
                await self._save()
            except PigeonError as exc:
                log.warning("closing ledger failed topic=%s error=%s", self.topic, exc)
        if writer is not None:
            if writer.failed is None and writer.pending:
                writer.abort(ServiceUnavailable(f"topic {self.topic} is closed"))
            writer.close()
        pending, self._pending = list(self._pending), deque()
        for append in pending:
            try:
                append.callback(None, ServiceUnavailable(f"topic {self.topic} was closed"))
            except Exception:
                log.exception("append callback failed topic=%s", self.topic)
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

    def segment_index_before(self, pos: Position) -> int | None:
        """The index of the segment holding the entries just before ``pos``: its own when
        ``pos`` is inside a segment past its first entry, else the one before it; None at
        the start of the log."""
        seg_id, entry = pos
        index = self._index.get(seg_id)
        if index is None:
            index = bisect.bisect_left([s.id for s in self.segments], seg_id)
        elif entry > 0:
            return index
        while index > 0:
            index -= 1
            if self.segments[index].last_entry_id >= 0:
                return index
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
            try:
                raw = await self.policy.read(
                    seg.id,
                    ensemble,
                    entry_id,
                    last,
                    max_bytes=max_bytes,
                    max_count=max_entries,
                    write_quorum=seg.write_quorum or None,
                    # copies found damaged are repaired, unless a writer still appends
                    repair=seg.state == "closed",
                )
            except _UNREADABLE as exc:
                raise CorruptEntry(
                    f"topic {self.topic} segment {seg.id} entry {entry_id} is on no replica"
                    f" intact: {exc}"
                ) from None
            if not raw:
                raise CorruptEntry(
                    f"topic {self.topic} segment {seg.id} entry {entry_id} is on no replica"
                )
            for eid2, data in raw:
                out.append(self._entry(seg, eid2, data))
        return out

    # Damaged entries: an entry the metadata says is stored that no replica holds
    # intact makes ``read`` raise CorruptEntry.  ``skip_damaged`` finds where the run of
    # such entries ends, so that readers can go on past it (subscriptions do, or stop,
    # per their corrupt-entry policy); the runs found are remembered and counted.

    @property
    def corrupt_entries(self) -> int:
        """Entries found on no replica intact since the ledger was opened."""
        return sum(r.count_in(0, 1 << 63) for r in self._damaged.values())

    @property
    def damaged_runs(self) -> list[DamagedRun]:
        return list(self._damaged_runs)

    def _record_damage(self, run: DamagedRun) -> bool:
        """Remember ``run``; False if it was known already."""
        ids = self._damaged.setdefault(run.segment_id, RangeSet())
        new = ids.count_in(run.first_entry, run.last_entry + 1) < run.entries
        ids.add(run.first_entry, run.last_entry + 1)
        if new:
            self._damaged_runs.append(run)
        return new

    def known_damage(self, pos: Position) -> DamagedRun | None:
        """The damaged run found earlier that holds ``pos``, if any."""
        for run in self._damaged_runs:
            if run.segment_id == pos[0] and run.first_entry <= pos[1] <= run.last_entry:
                return run
        return None

    async def skip_damaged(self, pos: Position) -> DamagedRun:
        """The run of damaged entries that starts at ``pos`` (where ``read`` raised
        CorruptEntry) and where reading goes on after it.

        Reads forward one entry at a time (a run past the last entry any replica of the
        segment stores is the rest of the segment at once), galloping after
        ``DAMAGE_PROBES`` damaged entries.  Raises a retriable error when bookies do not
        answer (the run's end cannot be known yet).
        """
        npos = self.normalize(pos) or pos
        known = self.known_damage(npos)
        if known is not None:
            return known
        seg_id, first = npos
        index = self._index.get(seg_id)
        if index is None:
            raise EntryNotFound(f"topic {self.topic} has no segment {seg_id}")
        seg = self.segments[index]
        ensemble, fragment_end = seg.ensemble_for(first)
        stored = getattr(self.policy, "stored_last_entry", None)
        after: Entry | None = None
        k = seg.last_entry_id + 1
        if stored is None or fragment_end >= 0 or int(await stored(seg.id, ensemble)) >= first:
            end = seg.last_entry_id
            k, step, probes, bad = first + 1, 1, 0, first  # bad: last entry seen damaged
            while k <= end:
                try:
                    after = await self.read_one((seg.id, k))
                    break
                except CorruptEntry:
                    bad = k
                probes += 1
                if probes >= DAMAGE_PROBES:
                    step *= 2  # a whole damaged region: gallop
                k = k + step if k + step <= end or k == end else end
            if after is not None and after.entry_id > bad + 1:
                after = await self._first_readable(seg, bad + 1, after)
            k = after.entry_id if after is not None else end + 1
        if after is not None:
            end_offset = after.first_offset
        elif index + 1 < len(self.segments):
            end_offset = self.segments[index + 1].first_offset
        else:
            end_offset = self.next_offset
        run = DamagedRun(seg.id, first, k - 1, (seg.id, k), end_offset)
        if self._record_damage(run):
            log.error(
                "damaged entries topic=%s segment=%s entries=%s..%s (%s) are on no replica"
                " intact; readers go on at entry %s (offset %s)",
                self.topic,
                seg.id,
                run.first_entry,
                run.last_entry,
                run.entries,
                k,
                end_offset,
            )
        return run

    async def _first_readable(self, seg: SegmentInfo, lo: int, found: Entry) -> Entry:
        """After galloping: the first readable entry in ``lo..found`` (binary search,
        taking the damage as one stretch)."""
        hi = found.entry_id
        best = found
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                best = await self.read_one((seg.id, mid))
                hi = mid
            except CorruptEntry:
                lo = mid + 1
        return best if best.entry_id == lo else found

    async def _read_near(self, seg: SegmentInfo, k: int, hi: int) -> Entry | None:
        """Entry ``k``, or the first readable one after it up to ``hi`` (a few tried)."""
        for j in range(k, min(hi, k + NEAR_PROBES) + 1):
            try:
                return await self.read_one((seg.id, j))
            except CorruptEntry:
                continue
        return None

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
            # a damaged entry is passed over: at worst an earlier position is returned
            entry = await self._read_near(seg, mid, hi)
            if entry is not None and entry.first_offset <= offset:
                lo = entry.entry_id
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
                # a damaged entry is passed over: at worst an earlier position is returned
                entry = await self._read_near(seg, mid, hi)
                if entry is None or entry.publish_time >= timestamp_ms:
                    hi = mid
                else:
                    lo = entry.entry_id + 1
            return (seg.id, lo)
        return self.end_position()
