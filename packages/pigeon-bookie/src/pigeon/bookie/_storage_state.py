"""The in-memory state of a :class:`~pigeon.bookie.SegmentStore` and of each open
segment, the names of its files and the raw I/O helpers its parts share.

:class:`StoreBase` holds the configuration and the state; the store's concerns are
layered on it in their own modules (:mod:`~pigeon.bookie._storage_reads`,
:mod:`~pigeon.bookie._storage_recovery`, :mod:`~pigeon.bookie._storage_commit`,
:mod:`~pigeon.bookie._storage_writes`) and put together in
:mod:`~pigeon.bookie._storage`.
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import os
import queue
import threading
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Literal, Protocol, TypeVar

import outcome
import trio

from pigeon.bookie._index import (
    INDEX_HEADER_SIZE,
    INDEX_RECORD_SIZE,
    SparseIndex,
    decode_checkpoints,
)
from pigeon.bookie._segment import FILE_HEADER_SIZE, Buffer, IdRanges
from pigeon.core.errors import (
    BookieReadOnly,
    CorruptEntry,
    EntryNotFound,
    InvalidArgument,
    InvalidEntryId,
    SegmentNotFound,
    ServiceUnavailable,
)
from pigeon.core.storage import SegmentInfo, StoreStatistics

__all__ = [
    "logger",
    "IOV_MAX",
    "MAX_ENTRY_ID",
    "MAX_SEGMENT_ID",
    "SEGMENTS_DIR",
    "STORE_FORMAT",
    "TAIL_CHECKPOINTS",
    "DEFAULT_PAGE_CACHE_WINDOW",
    "DROP_BEHIND_ALIGN",
    "DROP_BEHIND_STEP",
    "DropBehind",
    "drop_behind",
    "next_drop",
    "Counters",
    "FlushThread",
    "InlineSyncs",
    "FsyncPolicy",
    "Round",
    "SegmentInfo",
    "SegmentState",
    "StoreBase",
    "StoreStatistics",
    "as_buffer",
    "check_segment_id",
    "file_name",
    "pread",
    "pwritev_all",
    "ReadOnlyState",
    "stored_damaged",
]

#: one logger for the whole store, whichever module of it logs (log filters name it)
logger = logging.getLogger("pigeon.bookie._storage")


FsyncPolicy = Literal["always", "interval", "never"]

STORE_FORMAT: Final = b"pigeon-segment-store 1\n"
SEGMENTS_DIR: Final = "segments"
MAX_SEGMENT_ID: Final = (1 << 64) - 1
MAX_ENTRY_ID: Final = (1 << 63) - 1
IOV_MAX: Final = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
#: index checkpoints read from the end of an index file when a segment is recovered
TAIL_CHECKPOINTS: Final = 64
#: of each data file, the most recent bytes written that stay in the page cache once
#: durable (see :func:`drop_behind`)
DEFAULT_PAGE_CACHE_WINDOW: Final = 64 << 20
#: pages are dropped this many bytes at a time at least (one fadvise call) ...
DROP_BEHIND_STEP: Final = 4 << 20
#: ... up to a multiple of this (a page boundary, whatever the page size): the kernel
#: drops whole pages only, so an unaligned end would leave one behind each time
DROP_BEHIND_ALIGN: Final = 64 << 10


def file_name(segment_id: int, suffix: str) -> str:
    return f"{segment_id:016x}{suffix}"


def pread(fd: int, pos: int, n: int) -> bytes:
    return os.pread(fd, n, pos)


def pwritev_all(fd: int, bufs: list[Buffer], offset: int, total: int) -> None:
    """Write all of ``bufs`` (``total`` bytes) at ``offset``, retrying short writes,
    at most IOV_MAX buffers a call."""
    if len(bufs) <= IOV_MAX and os.pwritev(fd, bufs, offset) == total:
        return  # the usual case: one syscall
    pending: list[Buffer] = list(bufs)
    while pending:
        batch = pending[:IOV_MAX]
        n = os.pwritev(fd, batch, offset)
        offset += n
        if n == sum(len(b) for b in batch):
            del pending[: len(batch)]
            continue
        while n >= len(pending[0]):
            n -= len(pending.pop(0))
        pending[0] = memoryview(pending[0])[n:]


#: a range of a data file to drop from the page cache: ``(fd, offset, length)``
DropBehind = tuple[int, int, int]


class _Droppable(Protocol):
    """A file whose written pages are dropped from the page cache bit by bit."""

    fd: int
    #: pages before this offset were dropped already
    cached_from: int


def next_drop(f: _Droppable, end: int, window: int, *, retry: int = 0) -> DropBehind | None:
    """The range of ``f`` (written up to ``end``) to drop now, keeping the last
    ``window`` bytes (-1: keep all) and dropping the last ``retry`` bytes before
    ``f.cached_from`` again; None while that is under :data:`DROP_BEHIND_STEP`.
    Moves ``f.cached_from`` to the end of the range returned."""
    if window < 0:
        return None
    start = max(0, f.cached_from - retry) // DROP_BEHIND_ALIGN * DROP_BEHIND_ALIGN
    upto = (end - window) // DROP_BEHIND_ALIGN * DROP_BEHIND_ALIGN
    if upto - start < DROP_BEHIND_STEP:
        return None
    f.cached_from = upto
    return f.fd, start, upto - start


def drop_behind(ranges: list[DropBehind]) -> None:
    """Blocking: drop these ranges of files from the page cache (their bytes are on
    disk already), so that the kernel reuses that memory for the next writes.

    Written data is read back seldom (a tailing reader is served by the broker's
    cache), and every page kept makes the page cache grow into memory nobody has
    touched yet.  Where that memory is backed lazily (a Firecracker VM, measured
    here: docs/benchmarks.md, "Drop-behind"), each new page costs a fault on the host
    inside the kernel's copy, ~2.5 ms of CPU per MiB written against ~0.25 ms for a
    page the kernel had freed a moment ago.  BookKeeper drops its journal's pages the
    same way (``journalRemovePagesFromCache``).  Only whole clean pages go: a dirty
    page or one still being written back stays, so nothing is lost whatever the
    range; errors are ignored (the pages just stay cached).
    """
    if not hasattr(os, "posix_fadvise"):
        return
    for fd, offset, length in ranges:
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def as_buffer(data: Buffer) -> Buffer:
    """``data`` as a buffer of bytes the store can checksum and write as it is: ``bytes``
    and a flat memoryview of bytes unchanged (no copy: a received frame's payload goes
    to the file as the view it arrived in), any other contiguous buffer as a view."""
    if type(data) is bytes:
        return data
    try:
        view = data if type(data) is memoryview else memoryview(data)
    except TypeError:
        raise InvalidArgument(f"entry data must be bytes-like, not {type(data).__name__}")
    if not view.c_contiguous:
        raise InvalidArgument("entry data must be a contiguous buffer")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def check_segment_id(segment_id: int) -> None:
    if not 0 <= segment_id <= MAX_SEGMENT_ID:
        raise InvalidArgument(f"segment id out of range: {segment_id}")


class Counters:
    __slots__ = (
        "bytes_read",
        "bytes_written",
        "corrupt",
        "entries_read",
        "entries_written",
        "flush_rounds",
        "flush_seconds",
        "fsyncs",
        "inline_rounds",
        "repaired",
        "torn_entries",
        "torn_tails",
        "verified_bytes",
    )

    def __init__(self) -> None:
        self.entries_written = self.bytes_written = 0
        self.entries_read = self.bytes_read = 0
        self.fsyncs = self.flush_rounds = self.corrupt = self.inline_rounds = 0
        self.flush_seconds = 0.0
        self.torn_tails = self.torn_entries = self.verified_bytes = self.repaired = 0


class SegmentState:
    """In-memory state of one segment; mutated only from the trio thread."""

    __slots__ = (
        "base",
        "cached_from",
        "closed",
        "corrupt",
        "deleted",
        "end",
        "fd",
        "fenced",
        "id",
        "idle",
        "idx_count",
        "idx_fd",
        "lac",
        "last_cp_pos",
        "meta_lock",
        "meta_size",
        "next_id",
        "refs",
        "sparse",
        "starts",
        "touched",
    )

    def __init__(
        self,
        segment_id: int,
        fd: int,
        idx_fd: int,
        *,
        base: int = 0,
        starts: array[int] | None = None,
        next_id: int = 0,
        end: int = FILE_HEADER_SIZE,
        lac: int = -1,
        fenced: bool = False,
        corrupt: IdRanges | None = None,
        last_cp_pos: int = FILE_HEADER_SIZE,
        idx_count: int = 0,
        meta_size: int = 0,
    ) -> None:
        self.id = segment_id
        self.fd = fd
        self.idx_fd = idx_fd
        #: entry id of ``starts[0]``; ``starts[i]`` is where entry ``base + i`` starts
        self.base = base
        self.starts: array[int] = starts if starts is not None else array("q")
        self.next_id = next_id
        #: end of the data written (the next record goes here)
        self.end = end
        self.lac = lac
        self.fenced = fenced
        #: entries that cannot be returned (damaged, or lost with damaged bytes)
        self.corrupt: IdRanges = corrupt if corrupt is not None else IdRanges()
        self.last_cp_pos = last_cp_pos
        #: checkpoints stored in the index file
        self.idx_count = idx_count
        self.meta_size = meta_size
        #: pages before this offset were dropped from the page cache once durable
        #: (``page_cache_window_bytes``)
        self.cached_from = 0
        self.sparse: SparseIndex | None = None
        self.meta_lock: trio.Lock | None = None
        #: worker threads using the file descriptors; they are closed only at 0
        self.refs = 0
        self.idle: trio.Event | None = None
        self.closed = False  #: file descriptors closed
        self.deleted = False
        #: trio clock time of the last add, fence or creation (during recovery: the
        #: wall clock mtime of the segment's files, converted when the store starts)
        self.touched = 0.0

    def acquire(self) -> None:
        self.refs += 1

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0 and self.idle is not None:
            self.idle.set()

    async def wait_idle(self) -> None:
        while self.refs:
            self.idle = trio.Event()
            await self.idle.wait()

    def disk_usage(self) -> int:
        return self.end + INDEX_HEADER_SIZE + self.idx_count * INDEX_RECORD_SIZE + self.meta_size


def stored_damaged(
    read_entries: Callable[[int, int, int], list[tuple[int, bytes]]],
    segment_id: int,
    entry_id: int,
    last_entry_id: int,
    payload: Buffer,
) -> bool:
    """A recovery add of ``entry_id`` at or below the segment's last entry: True if the
    entry is stored damaged (the store repairs it, if the bytes provably belong), False
    if it is stored with these very bytes (nothing to write).  Raises InvalidEntryId for
    an id the writer skipped or other bytes than stored (both backends alike)."""
    try:
        stored = read_entries(segment_id, entry_id, entry_id)
    except EntryNotFound:
        raise InvalidEntryId(
            f"segment={segment_id} entry={entry_id} was skipped and cannot be"
            f" added below the last entry {last_entry_id}"
        ) from None
    except CorruptEntry:
        return True
    if stored[0][1] != payload:
        raise InvalidEntryId(f"segment={segment_id} entry={entry_id} stored with other content")
    return False


T = TypeVar("T")


class FlushThread:
    """A thread of the group commit's own for its blocking calls (fdatasync, the
    journal's entry-log writes): a call costs half the CPU and wall time of
    ``trio.to_thread.run_sync`` (measured here: ~62 against ~111 us of CPU, 69 against
    134 us of wall time per call), which a round pays once per segment-group or log.

    Calls run one at a time, in order.  The thread starts on the first call and ends
    after ``idle_s`` without one (so a store dropped without closing leaves no thread
    behind); :meth:`run` is not cancellable (rounds run shielded anyway).
    """

    def __init__(self, name: str, idle_s: float = 10.0) -> None:
        self._name = name
        self._idle = idle_s
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Callable[[Any], None]]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._running = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the thread; its result, or its exception raised here."""
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()
        box: list[outcome.Outcome[T]] = []

        def done(result: outcome.Outcome[T]) -> None:
            box.append(result)
            token.run_sync_soon(trio.lowlevel.reschedule, task)

        with self._lock:
            if not self._running:
                # started first: a thread that cannot start (RuntimeError) leaves no
                # call queued and no thread assumed running
                threading.Thread(target=self._serve, name=self._name, daemon=True).start()
                self._running = True
            self._queue.put((functools.partial(fn, *args), done))
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        return box[0].unwrap()

    def _serve(self) -> None:
        while True:
            try:
                call, done = self._queue.get(timeout=self._idle)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._running = False
                        return
                continue
            result = outcome.capture(call)
            try:
                done(result)
            except trio.RunFinishedError:  # the trio run ended meanwhile: nobody waits
                pass


class InlineSyncs:
    """When a small group commit runs its blocking calls on the event loop itself.

    Handing a round to a :class:`FlushThread` costs two thread hops, and on a busy
    process each waits for the GIL: a 12 KiB round whose write + fdatasync take
    ~0.4 ms took ~0.8 ms through the thread with the loop 30 % busy
    (``python -m bench.storage_micro --segments 1 --size 12288 --rate 1000 --busy 0.3
    --stores journal journal-thread``).  A round of at most ``max_bytes`` therefore runs
    inline, unless the disk turned slow, where blocking the loop would hold up every
    other connection of the process: half of the last :data:`WINDOW` inline rounds over
    ``max_s``, or one over :data:`STALL_S`.  Then rounds go to the thread again for
    ``cooldown_s``.  A lone hiccup of a few ms, frequent on a shared VM, does not count;
    one of 50 ms does: an inline round holds every connection of the process, and slow
    fdatasyncs come in bursts here (the ``StallWatch`` of ``pigeon.core._stalls`` counted
    18 stalls of 20-226 ms of the event loop in one 5 s run at 10 MB/s, every one an
    inline round; docs/benchmarks.md).  ``max_bytes`` 0: never inline.
    """

    #: inline rounds looked back at
    WINDOW = 32
    #: one inline round this long sends rounds to the thread at once
    STALL_S = 0.05

    __slots__ = ("_recent", "_until", "cooldown_s", "max_bytes", "max_s", "slow")

    def __init__(self, max_bytes: int, max_s: float, cooldown_s: float = 10.0) -> None:
        self.max_bytes = max_bytes
        self.max_s = max_s
        self.cooldown_s = cooldown_s
        #: times the disk was found slow (rounds sent back to the thread)
        self.slow = 0
        #: whether each of the last WINDOW inline rounds was over ``max_s``
        self._recent: collections.deque[bool] = collections.deque(maxlen=self.WINDOW)
        self._until = -float("inf")

    def allowed(self, nbytes: int) -> bool:
        """May a round of ``nbytes`` run inline now?"""
        return nbytes <= self.max_bytes and time.monotonic() >= self._until

    def ran(self, seconds: float) -> None:
        """An inline round took ``seconds``."""
        self._recent.append(seconds > self.max_s)
        if sum(self._recent) * 2 >= self.WINDOW or seconds >= self.STALL_S:
            self.slow += 1
            self._recent.clear()
            self._until = time.monotonic() + self.cooldown_s


class Round:
    """One group commit: the segments written since the previous round (a journal
    store's round adds the journal files: ``pigeon.bookie._journal_state.JournalRound``)."""

    __slots__ = ("callbacks", "done", "error", "segments")

    def __init__(self) -> None:
        self.segments: dict[int, SegmentState] = {}
        self.done = trio.Event()
        self.error: OSError | None = None
        self.callbacks: list[Callable[[], object]] = []

    def finish(self) -> None:
        self.done.set()
        callbacks, self.callbacks = self.callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:
                logger.exception("append callback failed")


class ReadOnlyState:
    """The read-only state of a store (both backends): an I/O error on the write path,
    a full disk, or the service's free-space check make it refuse adds."""

    _read_only: str | None
    #: the read-only state lasts until a restart (an I/O error other than a full disk)
    _read_only_sticky: bool

    def _io_failed(self, what: str, exc: OSError) -> BookieReadOnly:
        """An I/O error on the write path: the bookie turns read-only (as BookKeeper
        does) so that writers move to other bookies.

        A full disk (ENOSPC/EDQUOT from a write) is cleared by :meth:`set_read_only`
        once space is back; any other error, and any failed fsync (after which the page
        cache cannot be trusted), lasts until the store restarts.
        """
        reason = f"{what}: {exc.strerror or exc}"
        disk_full = exc.errno in (errno.ENOSPC, errno.EDQUOT) and what != "fsync"
        if self._read_only is None or (not disk_full and not self._read_only_sticky):
            self._read_only = reason
            level = logging.WARNING if disk_full else logging.ERROR
            logger.log(level, "bookie turns read-only reason=%s", reason)
        self._read_only_sticky = self._read_only_sticky or not disk_full
        return BookieReadOnly(reason)

    @property
    def read_only(self) -> str | None:
        """Why the store refuses adds (BookieReadOnly), or None when it is writable."""
        return self._read_only

    def set_read_only(self, reason: str | None) -> bool:
        """Refuse adds from now on (``reason``), or accept them again (None).

        The service calls it when free disk space crosses its threshold.  Going
        writable again does not undo a read-only state caused by an I/O error other
        than a full disk (that lasts until a restart); returns whether the store is
        writable afterwards.
        """
        if reason is not None:
            if self._read_only is None:
                self._read_only = reason
                logger.warning("bookie turns read-only reason=%s", reason)
        elif self._read_only is not None and not self._read_only_sticky:
            logger.info("bookie writable again (was: %s)", self._read_only)
            self._read_only = None
        return self._read_only is None


class StoreBase(ReadOnlyState):
    """Configuration and state of a store (see :class:`~pigeon.bookie.SegmentStore`),
    and what every part of it uses: the running check, the segment lookup, the
    read-only state and the sparse index of a segment."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy = "always",
        fsync_interval_ms: float = 5.0,
        index_interval_bytes: int = 64 * 1024,
        inline_read_bytes: int = 256 * 1024,
        flush_threads: int = 4,
        verify_tail_bytes: int = 1 << 20,
        page_cache_window_bytes: int = DEFAULT_PAGE_CACHE_WINDOW,
    ) -> None:
        if fsync not in ("always", "interval", "never"):
            raise InvalidArgument(f"fsync must be 'always', 'interval' or 'never', not {fsync!r}")
        if fsync_interval_ms <= 0:
            raise InvalidArgument("fsync_interval_ms must be > 0")
        if index_interval_bytes < 1:
            raise InvalidArgument("index_interval_bytes must be >= 1")
        if flush_threads < 1:
            raise InvalidArgument("flush_threads must be >= 1")
        if verify_tail_bytes < 0:
            raise InvalidArgument("verify_tail_bytes must be >= 0")
        if page_cache_window_bytes < -1:
            raise InvalidArgument("page_cache_window_bytes must be >= 0, or -1 (off)")
        self._root = Path(data_dir)
        self._dir = self._root / SEGMENTS_DIR
        self._policy: FsyncPolicy = fsync
        self._interval = fsync_interval_ms / 1000.0
        self._index_interval = index_interval_bytes
        self._inline_read = inline_read_bytes
        self._flush_threads = flush_threads
        #: the group commit's threads (one per concurrent fsync group)
        self._fsync_threads = [
            FlushThread(f"pigeon-fsync-{i}") for i in range(max(1, flush_threads))
        ]
        self._verify_tail = verify_tail_bytes
        self._cache_window = page_cache_window_bytes
        #: dense positions kept per segment: beyond 2x this, the oldest half is dropped
        #: (reads of older entries go through the sparse index)
        self._dense_window = 1 << 16
        #: size of the windows the read path reads the data files in
        self._read_chunk = 128 << 10
        self._state: Literal["new", "starting", "running", "closing", "closed"] = "new"
        self._segments: dict[int, SegmentState] = {}
        self._lock_fd = -1
        self._dir_fd = -1
        self._dir_dirty = False
        #: why the store refuses writes (None: writable)
        self._read_only: str | None = None
        #: the read-only state lasts until a restart (an I/O error other than a full disk)
        self._read_only_sticky = False
        self._collecting = Round()
        self._flush_wanted = trio.Event()
        self._counters = Counters()

    def _check_running(self) -> None:
        if self._state != "running":
            raise ServiceUnavailable(f"segment store is {self._state}")

    def _get(self, segment_id: int) -> SegmentState:
        self._check_running()
        seg = self._segments.get(segment_id)
        if seg is None:
            raise SegmentNotFound(f"segment={segment_id} not found")
        return seg

    def _sparse_index(self, seg: SegmentState) -> SparseIndex:
        """The segment's checkpoints, read from its index file on first use."""
        if seg.sparse is None:
            try:
                buf = os.pread(seg.idx_fd, seg.idx_count * INDEX_RECORD_SIZE, INDEX_HEADER_SIZE)
            except OSError as exc:
                logger.warning("index unreadable segment=%d error=%s", seg.id, exc)
                buf = b""
            seg.sparse = SparseIndex(*decode_checkpoints(buf), next_id=seg.next_id, end=seg.end)
        return seg.sparse
