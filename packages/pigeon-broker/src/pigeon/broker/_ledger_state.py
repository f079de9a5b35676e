"""The ledger's state: its segments, their metadata document and positions in the log.

A ledger (see :mod:`pigeon.broker._ledger`) is an ordered list of segments; this module
holds the data kept about them (``SegmentInfo``, ``Entry``, ``DamagedRun``), the
compare-and-set save of the metadata document, the cache of recent entries, and the
position arithmetic (which segment holds a position, where the log starts and ends).
The write path (``_ledger_writes``) and the read path (``_ledger_reads``) build on
:class:`LedgerState`.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import trio

from pigeon.broker._cursor import RangeSet
from pigeon.broker._histogram import LatencyHistogram
from pigeon.core import ReplicationPolicy, SegmentWriter, TopicName
from pigeon.core.errors import BadVersion, NotOwner, PigeonError
from pigeon.core.paths import ledger_path
from pigeon.core.runtime import WallClock

__all__ = [
    "AppendCallback",
    "DamagedRun",
    "Entry",
    "LedgerConfig",
    "LedgerState",
    "Position",
    "SegmentInfo",
]

# one logger for the whole ledger (its modules log as ``pigeon.broker._ledger``)
log = logging.getLogger("pigeon.broker._ledger")

# (segment id, entry id). Segment ids grow with every new segment, so positions order as
# the log does, and they stay valid when retention trims segments off the head.
Position = tuple[int, int]
AppendCallback = Callable[[Any, BaseException | None], None]


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
    # Tiered storage: where the offloader stored the segment (None: only on bookies),
    # when (wall clock, ms), and whether the bookie copies were deleted since.
    offload: dict[str, Any] | None = None
    offload_time_ms: int = 0
    bookies_deleted: bool = False
    # An upload of the segment that was started and not recorded (yet): ``{"driver",
    # "key"}``, saved before the upload begins.  Whoever removes the segment (retention,
    # topic deletion) deletes that key too, so an upload cut short, or one still running
    # when the segment goes, leaves no object behind (see ``_ledger_offload``).
    offload_pending: dict[str, Any] | None = None
    #: fields of the stored document this version does not know (written by a newer
    #: broker during a rolling upgrade): kept, and written back as they were
    unknown_fields: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> SegmentInfo:
        """A segment as the ledger's metadata document holds it; fields this version
        does not know are kept aside, not refused."""
        known = _SEGMENT_FIELDS
        info = cls(**{k: v for k, v in doc.items() if k in known})
        info.unknown_fields = {k: v for k, v in doc.items() if k not in known}
        return info

    def to_doc(self) -> dict[str, Any]:
        doc = asdict(self)
        return {**doc.pop("unknown_fields"), **doc}

    def offloaded_objects(self) -> list[dict[str, Any]]:
        """What to delete from the offloader when the segment goes: its recorded
        location and the key of an upload not recorded (each once)."""
        out = [loc for loc in (self.offload, self.offload_pending) if loc is not None]
        if len(out) == 2 and out[0].get("key") == out[1].get("key"):
            out.pop()
        return out

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


_SEGMENT_FIELDS = frozenset(f.name for f in fields(SegmentInfo)) - {"unknown_fields"}
#: the top-level fields of the ledger's document this version writes
_LEDGER_FIELDS = frozenset(
    {"segments", "next_offset", "compacted", "compaction_pending", "offload_deleting"}
)


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


class LedgerState:
    """The state of one persistent topic partition, shared by its write and read paths."""

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
        #: called (synchronously) whenever entries were stored or the ledger closed: a
        #: subscription's wake-up, so that its dispatch loop waits on one event of its own
        #: (no task per wait watching this ledger's event)
        self._entry_watchers: set[Callable[[], None]] = set()
        self.closed = False
        self.msgs_in = 0
        self.bytes_in = 0
        #: accepted-to-stored time of every stored append (exported at /metrics)
        self.publish_latency = LatencyHistogram()
        self.last_trimmed_ensembles: dict[int, list[str]] = {}
        #: the segments the last trim removed (their offloaded objects go too)
        self.last_trimmed: list[SegmentInfo] = []
        #: where closed segments are offloaded (tiered storage); None: nowhere
        self.offloader: Any = None
        #: the last offload run (Pulsar's OffloadProcessStatus): NOT_RUN, RUNNING,
        #: SUCCESS, ERROR
        self.offload_status: dict[str, Any] = {"status": "NOT_RUN", "last_error": ""}
        self._offloading = False
        #: segments whose offload met an entry no replica holds intact, by segment id
        #: (skipped, kept on bookies, retried with backoff: see ``_ledger_offload``)
        self.offload_damaged: dict[int, Any] = {}
        #: offloaded objects of removed segments not deleted yet (``offload_deleting``
        #: in the document: the intent to delete, saved with the segments' removal)
        self.offload_deleting: list[dict[str, Any]] = []
        #: top-level fields of the stored document this version does not know
        self.unknown_doc_fields: dict[str, Any] = {}
        # Entries no replica holds intact (found by reads and at open), per segment id,
        # and the runs they form: see "Damaged entries" in skip_damaged.
        self._damaged: dict[int, RangeSet] = {}
        self._damaged_runs: list[DamagedRun] = []
        #: topic compaction (see ``_ledger_compaction``): the compacted ledger recorded
        #: in the metadata (None: never compacted), the id of one being written and not
        #: recorded yet (deleted if it never is), the last run's status
        self.compacted: Any = None
        self.compaction_pending: int | None = None
        self.compaction_status: dict[str, Any] = {"status": "NOT_RUN", "last_error": ""}
        #: set when the compaction running now ends (None: none is running)
        self._compaction_ended: trio.Event | None = None

    # ------------------------------------------------------------------ metadata

    def _doc(self) -> bytes:
        # next_offset: where the offsets went up to, should the end of the log be found
        # damaged when the ledger is opened again (see _open_tail)
        doc: dict[str, Any] = {
            "segments": [s.to_doc() for s in self.segments],
            "next_offset": self.next_offset,
        }
        if self.compacted is not None:
            doc["compacted"] = self.compacted.to_doc()
        if self.compaction_pending is not None:
            doc["compaction_pending"] = self.compaction_pending
        if self.offload_deleting:
            doc["offload_deleting"] = self.offload_deleting
        return json.dumps({**self.unknown_doc_fields, **doc}).encode()

    def _keep_unknown(self, doc: dict[str, Any]) -> None:
        """Keep the top-level fields of a stored document this version does not know
        (a newer broker's), to write them back as they were."""
        self.unknown_doc_fields = {k: v for k, v in doc.items() if k not in _LEDGER_FIELDS}

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
                    if other is None:
                        continue
                    # fields this version does not know are the other writer's (a newer
                    # auditor during a rolling upgrade): kept as stored, never reverted
                    seg.unknown_fields = {
                        k: v for k, v in other.items() if k not in _SEGMENT_FIELDS
                    }
                    if seg.state == "closed":
                        seg.ensemble = list(other["ensemble"])
                        seg.fragments = [list(f) for f in other.get("fragments", [])]
                        seg.initial_ensemble = list(other.get("initial_ensemble", []))
                self._keep_unknown(json.loads(stat.value))
                self._version = stat.version
        raise NotOwner(f"ledger {self.topic} was changed by another broker; giving up ownership")

    def watch_entries(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` each time entries are stored (and when the ledger closes),
        until :meth:`unwatch_entries`. ``wake`` must not block or raise: it runs in the
        write path (a subscription's sets its wake-up event)."""
        self._entry_watchers.add(wake)

    def unwatch_entries(self, wake: Callable[[], None]) -> None:
        self._entry_watchers.discard(wake)

    def _entries_changed(self) -> None:
        """Entries were stored (or the ledger closed): wake whoever waits for them."""
        for wake in self._entry_watchers:
            wake()

    def _reindex(self) -> None:
        self._index = {s.id: i for i, s in enumerate(self.segments)}
        self._known.update(self._index)

    # ------------------------------------------------------------------ positions

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

    @property
    def stored_offset(self) -> int:
        """One past the last stored (acknowledged) offset: ``next_offset`` less the
        appends still in flight (Kafka's high watermark)."""
        return self._pending[0].offset if self._pending else self.next_offset

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

    def index_of_segment(self, segment_id: int) -> int | None:
        return self._index.get(segment_id)
