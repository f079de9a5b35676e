"""SegmentStore: the storage engine of a bookie.

One append-only data file per segment, a sparse index beside it and a small meta file
(fenced flag, lac).  Byte layouts: :mod:`pigeon.bookie._segment` and
:mod:`pigeon.bookie._index` (and the package README, "On-disk format").

Entry ids grow but may skip: a bookie of a striped ensemble (E > Qw) stores only the
entries whose write set includes it, and a bookie that replaced a failed one starts
mid-segment.  An id the writer skipped is *not stored* (EntryNotFound, and left out of
range reads); an id that damaged bytes may have held is *corrupt* (CorruptEntry).

Write path (trio thread, per entry): one ``os.pwritev`` of ``[header, payload]`` at the
known end of the file, then an append to the in-memory position list (a skipped id
gets a zero-length span there; a jump over more than the dense window restarts it).
Durability is the flusher's job (group commit): every flush round takes the set of
files written since the previous round and ``fdatasync``\\ s each once, in worker
threads, while new appends go on into the next round.  Under ``always`` an add returns
after the round covering it; under ``interval`` rounds run every ``fsync_interval_ms``
and adds return after the write; under ``never`` only :meth:`SegmentStore.sync`, a
fence and shutdown fsync.

Read path: the entries' positions come from the in-memory dense position list (the
recent entries of each segment) or from the sparse index plus a forward scan; the file
is read with ``os.pread`` in large windows, each payload is checked against its CRC32C
and returned as ``bytes``.  Reads up to ``inline_read_bytes`` run in the trio thread
(page-cache copies of a few hundred KiB); larger ones and index scans run in a worker
thread, so a catch-up read never stalls appends for long.

Recovery (``run`` before ``task_status.started()``): for every segment, the last
checkpoint of its index that matches the data at least ``verify_tail_bytes`` before the
end of the file is found and the file is scanned from there to its end, every checksum
verified (from the checkpoint before, if the checkpoint's own record is torn): the cost
of a start is bounded by segments x ``verify_tail_bytes``, never by the data stored;
older damage is found by the checksum every read verifies.  The torn tail (everything
after the last record whose payload verifies) is truncated and logged with the entry
ids it held (an ERROR when the writer had confirmed some of them: acknowledged entries
are gone from this copy); damaged records followed by good ones are kept, logged and
reported as :class:`~pigeon.core.errors.CorruptEntry`, and so are the ids between the
records on either side of a damaged header; a missing or damaged index is rebuilt.

Repair: a recovery add of an entry stored damaged here (a reader found a good copy on
another bookie) rewrites it in place, but only where the bytes provably belong: over
the payload of a record whose intact header's checksum the new payload matches, or
over damaged bytes between two intact records that are exactly one record of that
entry long.  Anything else is refused (InvalidEntryId): an append-only file cannot
take an entry below its last one elsewhere.

Read-only: an I/O error on the write path makes the store refuse adds with the
retriable BookieReadOnly until a restart; a full disk (ENOSPC on a write) or the
service's free-space check (:meth:`SegmentStore.set_read_only`) only until space is
back.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import trio

from pigeon.bookie._index import (
    INDEX_HEADER_SIZE,
    INDEX_RECORD_SIZE,
    SparseIndex,
    decode_checkpoints,
    encode_checkpoints,
    encode_index_header,
)
from pigeon.bookie._segment import (
    FILE_HEADER_SIZE,
    MAX_PAYLOAD,
    RECORD_HEADER_SIZE,
    IdRanges,
    ReadFn,
    TailScan,
    collect_entries,
    crc32c,
    decode_meta,
    encode_file_header,
    encode_meta,
    encode_record_header,
    locate_record,
    parse_record_header,
    scan_tail,
)
from pigeon.core.errors import (
    BookieReadOnly,
    CorruptEntry,
    EntryNotFound,
    InvalidArgument,
    InvalidEntryId,
    SegmentFenced,
    SegmentNotFound,
    ServiceUnavailable,
    StorageError,
)

__all__ = ["AppendWaiter", "FsyncPolicy", "SegmentInfo", "SegmentStore", "StoreStatistics"]

logger = logging.getLogger(__name__)

FsyncPolicy = Literal["always", "interval", "never"]

STORE_FORMAT: Final = b"pigeon-segment-store 1\n"
_SEGMENTS_DIR: Final = "segments"
_MAX_SEGMENT_ID: Final = (1 << 64) - 1
_MAX_ENTRY_ID: Final = (1 << 63) - 1
_IOV_MAX: Final = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
#: index checkpoints read from the end of an index file when a segment is recovered
_TAIL_CHECKPOINTS: Final = 64


def _name(segment_id: int, suffix: str) -> str:
    return f"{segment_id:016x}{suffix}"


def _pread(fd: int, pos: int, n: int) -> bytes:
    return os.pread(fd, n, pos)


#: How far past a read the kernel is asked to prefetch (sequential catch-up readers ask
#: for the next range right after this one).
READ_AHEAD_BYTES = 8 * 1024 * 1024


def _read_ahead(fd: int, pos: int, file_end: int) -> None:
    """Read-ahead for catch-up reads: prefetch the bytes after ``pos`` into the page cache."""
    n = min(READ_AHEAD_BYTES, file_end - pos)
    if n > 0 and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, pos, n, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass


def _pwritev_all(fd: int, bufs: list[bytes], offset: int, total: int) -> None:
    """Write all of ``bufs`` (``total`` bytes) at ``offset``, retrying short writes,
    at most IOV_MAX buffers a call."""
    if len(bufs) <= _IOV_MAX and os.pwritev(fd, bufs, offset) == total:
        return  # the usual case: one syscall
    pending: list[bytes | memoryview] = list(bufs)
    while pending:
        batch = pending[:_IOV_MAX]
        n = os.pwritev(fd, batch, offset)
        offset += n
        if n == sum(len(b) for b in batch):
            del pending[: len(batch)]
            continue
        while n >= len(pending[0]):
            n -= len(pending.pop(0))
        pending[0] = memoryview(pending[0])[n:]


def _fsync_many(fds: list[int], dir_fd: int | None) -> OSError | None:
    try:
        for fd in fds:
            os.fdatasync(fd)
        if dir_fd is not None:
            os.fsync(dir_fd)
    except OSError as exc:
        return exc
    return None


def _as_bytes(data: bytes | bytearray | memoryview) -> bytes:
    """The payload as ``bytes`` (the CRC32C binding takes nothing else); no copy for
    ``bytes`` or a memoryview spanning a whole ``bytes`` object."""
    if type(data) is bytes:
        return data
    try:
        mv = memoryview(data)
    except TypeError:
        raise InvalidArgument(f"entry data must be bytes-like, not {type(data).__name__}")
    if not mv.c_contiguous:
        raise InvalidArgument("entry data must be a contiguous buffer")
    obj = mv.obj
    if type(obj) is bytes and mv.nbytes == len(obj):
        return obj
    return mv.tobytes()


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """State of one stored segment."""

    segment_id: int
    #: highest entry id stored (-1: none).  Ids below it may be absent: a bookie of a
    #: striped ensemble stores only some entries, a replacement bookie starts mid-segment
    last_entry_id: int
    #: highest last-add-confirmed the writer piggybacked on an add (-1: none)
    lac: int
    #: fenced segments refuse adds (except recovery adds)
    fenced: bool
    #: size of the data file in bytes
    size_bytes: int
    #: ``last_entry_id + 1``: the entry ids the segment spans (the entries stored when
    #: ids are contiguous from 0; an upper bound when they skip)
    entry_count: int
    #: entries known (from recovery) to be damaged; reading them raises CorruptEntry
    corrupt_entries: int


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """Counters since the store started, and its current size."""

    segments: int
    entries_written: int
    #: record bytes appended (headers included)
    bytes_written: int
    entries_read: int
    #: payload bytes returned by reads
    bytes_read: int
    #: fsync/fdatasync calls (data files, directory, meta files)
    fsyncs: int
    flush_rounds: int
    #: bytes of all segment files (data, index, meta)
    disk_usage_bytes: int
    #: damaged entries found by reads (each read of a damaged entry counts)
    corrupt_entries_detected: int
    read_only: bool
    #: why the store is read-only ("" when writable)
    read_only_reason: str = ""
    #: wall time spent in group-commit fsync rounds (divide by flush_rounds: latency)
    flush_seconds: float = 0.0
    #: entries known to be damaged now (found at start or by reads, not repaired since)
    damaged_entries: int = 0
    #: segments whose torn tail was truncated when the store started
    torn_tails: int = 0
    #: entries the store dropped with torn tails at start (intact headers counted)
    torn_entries: int = 0
    #: damaged entries rewritten from a good copy (recovery adds)
    repaired_entries: int = 0


class _Counters:
    __slots__ = (
        "bytes_read",
        "bytes_written",
        "corrupt",
        "entries_read",
        "entries_written",
        "flush_rounds",
        "flush_seconds",
        "fsyncs",
        "repaired",
        "torn_entries",
        "torn_tails",
        "verified_bytes",
    )

    def __init__(self) -> None:
        self.entries_written = self.bytes_written = 0
        self.entries_read = self.bytes_read = 0
        self.fsyncs = self.flush_rounds = self.corrupt = 0
        self.flush_seconds = 0.0
        self.torn_tails = self.torn_entries = self.verified_bytes = self.repaired = 0


class _Segment:
    """In-memory state of one segment; mutated only from the trio thread."""

    __slots__ = (
        "base",
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


class _Round:
    """One group commit: the segments written since the previous round."""

    __slots__ = ("callbacks", "done", "error", "segments")

    def __init__(self) -> None:
        self.segments: dict[int, _Segment] = {}
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


class AppendWaiter:
    """Returned by :meth:`SegmentStore.append`: when is the entry durable?"""

    __slots__ = ("_round", "_segment")

    def __init__(self, round: _Round | None, segment: _Segment) -> None:
        self._round = round
        self._segment = segment

    @property
    def done(self) -> bool:
        """True once durable per the policy (or failed: see :attr:`error`)."""
        return self._round is None or self._round.done.is_set()

    @property
    def error(self) -> StorageError | None:
        """Why the entry is not durable, once :attr:`done`; None if it is."""
        r = self._round
        if r is None or not r.done.is_set():
            return None
        if r.error is not None:
            return BookieReadOnly(f"fsync failed: {r.error}")
        if self._segment.deleted:
            return SegmentNotFound(f"segment={self._segment.id} was deleted")
        return None

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` (synchronously, from a trio task of the store) once
        :attr:`done`; at once if it already is.  Cheaper than a task per add that
        awaits :meth:`wait`: the RPC service answers a whole group commit this way."""
        r = self._round
        if r is None or r.done.is_set():
            fn()
        else:
            r.callbacks.append(fn)

    async def wait(self) -> None:
        """Return once durable; raise :attr:`error` if that failed."""
        if self._round is None:
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await self._round.done.wait()
        err = self.error
        if err is not None:
            raise err


class SegmentStore:
    """The segments of one bookie, on local disk under ``data_dir``.

    Start it with ``await nursery.start(store.run)``; every other method may be called
    only while :meth:`run` runs (else :class:`~pigeon.core.errors.ServiceUnavailable`).
    All methods are called from trio tasks of the same trio run.

    ``fsync``: ``always`` (an add returns once an fsync covers it), ``interval`` (fsync
    every ``fsync_interval_ms``; an add returns once written to the OS) or ``never``
    (fsync only on :meth:`sync`, fence and shutdown).  ``index_interval_bytes``: data
    bytes between two sparse index checkpoints.  ``inline_read_bytes``: reads of at
    most this many bytes whose positions are known run in the trio thread, larger ones
    in a worker thread.  ``flush_threads``: worker threads fsyncing files in parallel
    in one flush round.  ``verify_tail_bytes``: at start, at least this many bytes at the
    end of every segment are read and their checksums verified (see "Recovery").
    """

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
        self._root = Path(data_dir)
        self._dir = self._root / _SEGMENTS_DIR
        self._policy: FsyncPolicy = fsync
        self._interval = fsync_interval_ms / 1000.0
        self._index_interval = index_interval_bytes
        self._inline_read = inline_read_bytes
        self._flush_threads = flush_threads
        self._verify_tail = verify_tail_bytes
        #: dense positions kept per segment: beyond 2x this, the oldest half is dropped
        #: (reads of older entries go through the sparse index)
        self._dense_window = 1 << 16
        #: size of the windows the read path reads the data files in
        self._read_chunk = 128 << 10
        self._state: Literal["new", "starting", "running", "closing", "closed"] = "new"
        self._segments: dict[int, _Segment] = {}
        self._lock_fd = -1
        self._dir_fd = -1
        self._dir_dirty = False
        #: why the store refuses writes (None: writable)
        self._read_only: str | None = None
        #: the read-only state lasts until a restart (an I/O error other than a full disk)
        self._read_only_sticky = False
        self._collecting = _Round()
        self._flush_wanted = trio.Event()
        self._counters = _Counters()

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open and recover every segment, then serve until cancelled.

        On exit (shielded) everything written is fsynced and the files are closed.
        """
        if self._state != "new":
            raise RuntimeError("a SegmentStore runs only once")
        self._state = "starting"
        try:
            await trio.to_thread.run_sync(self._open_all)
        except BaseException:
            self._close_fds()
            self._state = "closed"
            raise
        now, wall = trio.current_time(), time.time()
        for seg in self._segments.values():  # file mtimes (wall clock) -> trio clock
            seg.touched = now - max(0.0, wall - seg.touched)
        self._state = "running"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._flusher)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self._shutdown()

    async def _shutdown(self) -> None:
        self._state = "closing"
        try:
            await self._flush_round()
            with trio.move_on_after(30):
                for seg in list(self._segments.values()):
                    await seg.wait_idle()
        finally:
            self._close_fds()
            self._state = "closed"

    def _close_fds(self) -> None:
        for seg in self._segments.values():
            if seg.refs:
                logger.warning("closing segment with reads in flight segment=%d", seg.id)
                continue
            seg.closed = True
            for fd in (seg.fd, seg.idx_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass
        for fd in (self._dir_fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._dir_fd = self._lock_fd = -1

    def _check_running(self) -> None:
        if self._state != "running":
            raise ServiceUnavailable(f"segment store is {self._state}")

    # ------------------------------------------------------------------ recovery

    def _open_all(self) -> None:
        """Blocking: lock the directory, recover every segment (worker thread)."""
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self._root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StorageError(f"data directory {self._root} is in use by another store")
        fmt = self._root / "FORMAT"
        if fmt.exists() and fmt.stat().st_size:
            if fmt.read_bytes() != STORE_FORMAT:
                raise StorageError(f"{fmt} names an unknown store format")
        else:
            tmp = fmt.with_suffix(".tmp")
            tmp.write_bytes(STORE_FORMAT)
            os.replace(tmp, fmt)
        self._dir_fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

        files: dict[int, set[str]] = {}
        changed = False
        for entry in os.scandir(self._dir):
            stem, dot, suffix = entry.name.partition(".")
            if suffix.endswith("tmp"):
                os.unlink(entry.path)
                changed = True
                continue
            if len(stem) != 16 or not dot or suffix not in ("log", "idx", "meta"):
                logger.warning("ignoring unknown file path=%s", entry.path)
                continue
            try:
                segment_id = int(stem, 16)
            except ValueError:
                logger.warning("ignoring unknown file path=%s", entry.path)
                continue
            files.setdefault(segment_id, set()).add(suffix)
        segments = self._segments  # filled as we go: run() closes them on failure
        for segment_id, kinds in sorted(files.items()):
            if "log" not in kinds:
                for suffix in kinds:  # leftovers of an interrupted delete
                    os.unlink(self._dir / _name(segment_id, "." + suffix))
                changed = True
                continue
            seg = self._recover_segment(segment_id)
            if seg is None:
                changed = True
            else:
                segments[segment_id] = seg
        if changed:
            os.fsync(self._dir_fd)
        c = self._counters
        damaged = sum(len(s.corrupt) for s in segments.values())
        logger.log(
            logging.WARNING if c.torn_tails or damaged else logging.INFO,
            "segment store open path=%s segments=%d verified_bytes=%d torn_tails=%d"
            " torn_entries=%d damaged_entries=%d",
            self._root,
            len(segments),
            c.verified_bytes,
            c.torn_tails,
            c.torn_entries,
            damaged,
        )

    def _read_meta(self, segment_id: int) -> tuple[bool, int, int, float] | None:
        """``(fenced, lac, size, mtime)`` from the meta file, None if there is none."""
        path = self._dir / _name(segment_id, ".meta")
        try:
            with path.open("rb") as f:
                buf = f.read()
                mtime = os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None
        meta = decode_meta(buf, segment_id)
        if meta is None:
            # A meta file is only ever replaced atomically: this is media damage.  Its
            # fenced flag may have been set, and a fence must win: assume fenced.
            logger.error("damaged meta file, assuming fenced segment=%d", segment_id)
            return True, -1, len(buf), mtime
        return meta[0], meta[1], len(buf), mtime

    def _recover_segment(self, segment_id: int) -> _Segment | None:
        meta = self._read_meta(segment_id)
        log_path = self._dir / _name(segment_id, ".log")
        idx_path = self._dir / _name(segment_id, ".idx")
        fd = os.open(log_path, os.O_RDWR | os.O_CLOEXEC)
        idx_fd = -1
        try:
            st = os.fstat(fd)
            size, mtime = st.st_size, st.st_mtime  # mtime: before recovery writes
            if size < FILE_HEADER_SIZE:
                if meta is None:  # created by a first add that never completed
                    os.close(fd)
                    fd = -1
                    log_path.unlink()
                    idx_path.unlink(missing_ok=True)
                    return None
                os.ftruncate(fd, 0)
                os.pwrite(fd, encode_file_header(segment_id), 0)
                os.fsync(fd)
                size = FILE_HEADER_SIZE
            elif os.pread(fd, FILE_HEADER_SIZE, 0) != encode_file_header(segment_id):
                logger.warning("damaged data file header segment=%d", segment_id)
            read = functools.partial(_pread, fd)

            idx_fd = os.open(idx_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            isize = os.fstat(idx_fd).st_size
            rebuild = os.pread(idx_fd, INDEX_HEADER_SIZE, 0) != encode_index_header(segment_id)
            if rebuild and size > FILE_HEADER_SIZE:
                logger.warning("index missing or damaged, rebuilding segment=%d", segment_id)
            # where the recovery scan may start: (entry id, position, checkpoints kept),
            # the index's last matching checkpoints first, the start of the file last
            starts: list[tuple[int, int, int]] = []
            more_checkpoints = False  # older checkpoints than those loaded exist
            if not rebuild:
                n = (isize - INDEX_HEADER_SIZE) // INDEX_RECORD_SIZE
                k = min(n, _TAIL_CHECKPOINTS)
                more_checkpoints = n > k
                ids, positions = decode_checkpoints(
                    os.pread(
                        idx_fd,
                        k * INDEX_RECORD_SIZE,
                        INDEX_HEADER_SIZE + (n - k) * INDEX_RECORD_SIZE,
                    )
                )
                for j in range(k - 1, -1, -1):
                    if _checkpoint_valid(read, segment_id, ids[j], positions[j], size):
                        starts.append((ids[j], positions[j], n - k + j + 1))
                if k and not starts:
                    logger.warning("index does not match data, rebuilding segment=%d", segment_id)
                    rebuild = True
            starts.append((0, FILE_HEADER_SIZE, 0))
            # Verify at least the last ``verify_tail_bytes``: start from the latest
            # checkpoint that far from the end (else the earliest loaded one; the start
            # of the file when it is that small).
            limit = size - self._verify_tail
            if limit <= FILE_HEADER_SIZE:
                starts = starts[-1:]
            else:
                first_ok = next((i for i, c in enumerate(starts) if c[1] <= limit), 0)
                if first_ok == len(starts) - 1 and len(starts) > 1 and more_checkpoints:
                    # every checkpoint loaded is inside the window (a small index
                    # interval): the earliest of them bounds the scan, not the file start
                    first_ok = len(starts) - 2
                starts = starts[first_ok:]
            for candidate in starts:
                cp_id, cp_pos, keep = candidate
                scan = scan_tail(
                    read,
                    segment_id,
                    cp_pos,
                    cp_id,
                    size,
                    interval=self._index_interval,
                    last_checkpoint=cp_pos,
                    max_dense=2 * self._dense_window,
                )
                if scan.records or cp_pos == FILE_HEADER_SIZE:
                    break
                # The checkpoint's own record is torn: the last entry stored is before
                # it (and with skipping ids, not necessarily cp_id - 1): scan again from
                # the checkpoint before, dropping this one.
            self._counters.verified_bytes += size - cp_pos
            meta_lac = meta[1] if meta is not None else -1
            if scan.end < size:
                self._log_torn_tail(segment_id, scan, meta_lac)
                os.ftruncate(fd, scan.end)
                os.fsync(fd)
            elif meta_lac >= scan.next_id:
                logger.error(
                    "confirmed entries missing segment=%d last_entry=%d lac=%d entries=%d..%d:"
                    " gone from this copy (restored from a replica when read, if one has them)",
                    segment_id,
                    scan.next_id - 1,
                    meta_lac,
                    scan.next_id,
                    meta_lac,
                )
            if scan.corrupt:
                logger.error(
                    "damaged entries found at start segment=%d count=%d entries=%s: reads"
                    " of them fail with CorruptEntry (repaired from a replica when read, if"
                    " one has them)",
                    segment_id,
                    len(scan.corrupt),
                    scan.corrupt,
                )
            if rebuild:
                os.ftruncate(idx_fd, 0)
                os.pwrite(idx_fd, encode_index_header(segment_id), 0)
            else:
                os.ftruncate(idx_fd, INDEX_HEADER_SIZE + keep * INDEX_RECORD_SIZE)
            if scan.checkpoints:
                os.pwrite(
                    idx_fd,
                    encode_checkpoints(scan.checkpoints),
                    INDEX_HEADER_SIZE + keep * INDEX_RECORD_SIZE,
                )
            fenced, lac, meta_size, meta_mtime = meta if meta is not None else (False, -1, 0, 0.0)
            if scan.records == 0 and meta is None and not scan.torn_whole:
                # nothing was ever acknowledged (whole records that fail their checksum
                # are damage, not an add cut short: the segment stays, empty)
                os.close(fd)
                os.close(idx_fd)
                fd = idx_fd = -1
                log_path.unlink()
                idx_path.unlink()
                return None
            seg = _Segment(
                segment_id,
                fd,
                idx_fd,
                base=scan.base,
                starts=scan.starts,
                next_id=scan.next_id,
                end=scan.end,
                lac=max(lac, scan.lac),
                fenced=fenced,
                corrupt=scan.corrupt,
                last_cp_pos=scan.checkpoints[-1][1] if scan.checkpoints else cp_pos,
                idx_count=keep + len(scan.checkpoints),
                meta_size=meta_size,
            )
            seg.touched = max(mtime, meta_mtime)  # wall clock, for now
            return seg
        except BaseException:
            for f in (fd, idx_fd):
                if f >= 0:
                    try:
                        os.close(f)
                    except OSError:
                        pass
            raise

    def _log_torn_tail(self, segment_id: int, scan: TailScan, meta_lac: int) -> None:
        """One line per truncated tail: what was dropped, and whether the writer had
        confirmed any of it (then acknowledged entries are gone from this copy)."""
        c = self._counters
        c.torn_tails += 1
        c.torn_entries += len(scan.torn_ids)
        confirmed = max(scan.torn_lac, meta_lac)
        kept_last = scan.next_id - 1
        if confirmed > kept_last:
            logger.error(
                "torn tail truncated segment=%d bytes=%d kept_last_entry=%d"
                " dropped_entries=%s confirmed_up_to=%d: entries %d..%d were acknowledged"
                " and are gone from this copy (restored from a replica when read, if one"
                " has them)",
                segment_id,
                scan.torn_bytes,
                kept_last,
                scan.torn_summary(),
                confirmed,
                kept_last + 1,
                confirmed,
            )
        else:
            logger.warning(
                "torn tail truncated segment=%d bytes=%d kept_last_entry=%d"
                " dropped_entries=%s (an unfinished write, or lost data)",
                segment_id,
                scan.torn_bytes,
                kept_last,
                scan.torn_summary(),
            )

    # ------------------------------------------------------------------ writes

    def append(
        self,
        segment_id: int,
        entry_id: int,
        data: bytes | bytearray | memoryview,
        *,
        lac: int = -1,
        recovery: bool = False,
    ) -> AppendWaiter:
        """Write entry ``entry_id`` now; the returned waiter tells when it is durable per
        the fsync policy.

        Entry ids must grow: ``entry_id`` must be above :meth:`last_entry_id` and may
        skip ids (a bookie of a striped ensemble stores only some entries of a segment;
        a replacement bookie starts mid-segment).  The first add creates the segment,
        whatever its id.  ``lac`` is the writer's last-add-confirmed (the store keeps
        the highest).  ``recovery=True`` is BookKeeper's recovery add: accepted on a
        fenced segment, and re-adding an entry already stored with identical bytes
        succeeds without writing; re-adding an entry stored *damaged* repairs it in
        place when its bytes provably belong there (see "Repair" in the module doc).

        Raises (at once) InvalidEntryId (not above the last entry id; for a recovery
        add, other bytes than stored or an id that was skipped), SegmentFenced,
        BookieReadOnly, InvalidArgument, ServiceUnavailable.
        """
        self._check_running()
        payload = _as_bytes(data)
        if recovery:
            seg = self._segments.get(segment_id)
            if seg is not None and 0 <= entry_id < seg.next_id:
                try:
                    stored = self.read_entries(segment_id, entry_id, entry_id)
                except EntryNotFound:
                    raise InvalidEntryId(
                        f"segment={segment_id} entry={entry_id} was skipped and cannot be"
                        f" added below the last entry {seg.next_id - 1}"
                    )
                except CorruptEntry:
                    self._repair(seg, entry_id, payload, lac)
                    return self._durability(seg)
                if stored[0][1] != payload:
                    raise InvalidEntryId(
                        f"segment={segment_id} entry={entry_id} stored with other content"
                    )
                return self._durability(seg)
        seg = self._segment_for_append(segment_id, entry_id, lac, recovery)
        self._append(seg, entry_id, [payload], lac)
        return self._durability(seg)

    async def add_entry(
        self,
        segment_id: int,
        entry_id: int,
        data: bytes | bytearray | memoryview,
        *,
        lac: int = -1,
        recovery: bool = False,
    ) -> None:
        """:meth:`append`, then wait until the entry is durable per the fsync policy.

        Cancelled while waiting for the fsync, the entry stays written (a retry gets
        InvalidEntryId): the writer must treat it as not acknowledged.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        await self.append(segment_id, entry_id, data, lac=lac, recovery=recovery).wait()

    async def add_entries(
        self,
        segment_id: int,
        first_entry_id: int,
        entries: Sequence[bytes | bytearray | memoryview],
        *,
        lac: int = -1,
        recovery: bool = False,
    ) -> None:
        """Append ``entries`` as ids ``first_entry_id, first_entry_id + 1, ...`` with
        one write and one durability wait; like :meth:`add_entry` otherwise
        (``first_entry_id`` may skip ids; ``recovery`` only lifts the fence here)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_running()
        payloads = [_as_bytes(d) for d in entries]
        if not payloads:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        seg = self._segment_for_append(segment_id, first_entry_id, lac, recovery)
        self._append(seg, first_entry_id, payloads, lac)
        await self._durability(seg).wait()

    def _segment_for_append(
        self, segment_id: int, entry_id: int, lac: int, recovery: bool
    ) -> _Segment:
        _check_segment_id(segment_id)
        if not 0 <= entry_id <= _MAX_ENTRY_ID:
            raise InvalidEntryId(f"entry id out of range: {entry_id}")
        if not -1 <= lac <= _MAX_ENTRY_ID:
            raise InvalidArgument(f"lac out of range: {lac}")
        if self._read_only is not None:
            raise BookieReadOnly(f"bookie is read-only: {self._read_only}")
        seg = self._segments.get(segment_id)
        if seg is None:
            seg = self._create_segment(segment_id)
        if seg.fenced and not recovery:
            raise SegmentFenced(f"segment={segment_id} is fenced")
        if entry_id < seg.next_id:
            raise InvalidEntryId(
                f"segment={segment_id} entry {entry_id} is not above the last entry"
                f" {seg.next_id - 1}"
            )
        return seg

    def _repair(self, seg: _Segment, entry_id: int, payload: bytes, lac: int) -> None:
        """Rewrite damaged entry ``entry_id`` in place with ``payload`` (a good copy),
        where its bytes provably belong; raise InvalidEntryId anywhere else.

        Blocking, but small: a scan from the sparse checkpoint before the entry (one
        index interval) and one ``pwrite``; the caller's durability waiter covers the
        fsync.
        """
        if self._read_only is not None:
            raise BookieReadOnly(f"bookie is read-only: {self._read_only}")
        read = functools.partial(_pread, seg.fd)
        sparse = self._sparse_index(seg)
        cp_id, cp_pos = sparse.lookup(entry_id)
        found = None
        for _attempt in range(8):
            found = locate_record(
                read,
                seg.id,
                cp_pos,
                cp_id,
                seg.end,
                entry_id,
                start_trusted=cp_pos == FILE_HEADER_SIZE,
                chunk=self._read_chunk,
            )
            if found is None or found.kind != "lost" or found.trusted or cp_id == 0:
                break
            # the damage starts at the checkpoint itself: scan from the one before
            cp_id, cp_pos = sparse.lookup(cp_id - 1)
        where = f"segment={seg.id} entry={entry_id}"
        if found is None:
            raise InvalidEntryId(f"{where} is not stored here: it cannot be added below the end")
        if found.kind == "record":
            if found.size - RECORD_HEADER_SIZE != len(payload) or crc32c(payload) != (
                found.payload_crc
            ):
                raise InvalidEntryId(f"{where} is stored with other content")
            bufs, at, how = [payload], found.pos + RECORD_HEADER_SIZE, "payload rewritten"
        else:
            if not (
                found.trusted
                and found.lo == found.hi == entry_id
                and found.size == RECORD_HEADER_SIZE + len(payload)
            ):
                raise InvalidEntryId(
                    f"{where}: the damaged bytes at {found.pos} ({found.size} bytes, ids"
                    f" {found.lo}..{found.hi}) cannot be rewritten with this entry alone"
                )
            header = encode_record_header(seg.id, entry_id, min(lac, entry_id - 1), payload)
            bufs, at, how = [header, payload], found.pos, "record rewritten"
        if found.kind == "lost" or not found.ok:
            try:
                _pwritev_all(seg.fd, bufs, at, sum(len(b) for b in bufs))
            except OSError as exc:
                raise self._io_failed(f"repair {where}", exc)
            if found.kind == "lost" and seg.base <= entry_id < seg.base + len(seg.starts):
                seg.starts[entry_id - seg.base] = found.pos
            self._counters.repaired += 1
            logger.warning(
                "damaged entry repaired from a good copy segment=%d entry=%d how=%s",
                seg.id,
                entry_id,
                how,
            )
        seg.corrupt.discard(entry_id)

    def _create_segment(self, segment_id: int) -> _Segment:
        """Create the files of a new segment (blocking, but two small writes)."""
        log_path = self._dir / _name(segment_id, ".log")
        try:
            fd = os.open(log_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:  # its delete has not finished yet
            raise StorageError(f"segment={segment_id} is being deleted")
        except OSError as exc:
            raise self._io_failed(f"create segment={segment_id}", exc)
        try:
            os.pwrite(fd, encode_file_header(segment_id), 0)
            idx_fd = os.open(
                self._dir / _name(segment_id, ".idx"),
                os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                0o644,
            )
        except OSError as exc:
            os.close(fd)
            log_path.unlink(missing_ok=True)
            raise self._io_failed(f"create segment={segment_id}", exc)
        try:
            os.pwrite(idx_fd, encode_index_header(segment_id), 0)
        except OSError as exc:
            logger.warning("index header write failed segment=%d error=%s", segment_id, exc)
        seg = _Segment(segment_id, fd, idx_fd)
        seg.touched = trio.current_time()
        self._segments[segment_id] = seg
        self._dir_dirty = True
        return seg

    def _append(self, seg: _Segment, entry_id: int, payloads: list[bytes], lac: int) -> None:
        """Write the records at the end of the data file (blocking: page-cache writes)."""
        bufs: list[bytes] = []
        checkpoints: list[tuple[int, int]] = []
        start = pos = seg.end
        old_base, old_starts = seg.base, seg.starts
        n_before = len(old_starts)  # on failure, the positions are cut back to this
        gap = entry_id - seg.next_id  # ids skipped: not stored here
        if gap and (gap > self._dense_window or not old_starts):
            # too many ids to give a position each: the dense positions start afresh
            # (older entries are found through the sparse index)
            seg.starts, seg.base = array("q"), entry_id
        starts = seg.starts
        if starts is old_starts and gap:
            starts.extend(array("q", [pos]) * gap)  # zero-length spans: not stored
        last_cp = seg.last_cp_pos
        interval = self._index_interval
        segment_id = seg.id
        eid = entry_id
        for payload in payloads:
            if len(payload) > MAX_PAYLOAD:
                del old_starts[n_before:]
                seg.base, seg.starts = old_base, old_starts
                raise InvalidArgument(f"entry of {len(payload)} bytes is too large")
            bufs.append(encode_record_header(segment_id, eid, lac, payload))
            bufs.append(payload)
            starts.append(pos)
            if pos - last_cp >= interval:
                checkpoints.append((eid, pos))
                last_cp = pos
            pos += RECORD_HEADER_SIZE + len(payload)
            eid += 1
        try:
            _pwritev_all(seg.fd, bufs, start, pos - start)
        except OSError as exc:
            del old_starts[n_before:]
            seg.base, seg.starts = old_base, old_starts
            try:  # drop a partial record so that the next write lands on clean bytes
                os.ftruncate(seg.fd, start)
            except OSError:
                pass
            raise self._io_failed(f"write segment={segment_id} entry={entry_id}", exc)
        seg.next_id = eid
        seg.end = pos
        seg.last_cp_pos = last_cp
        seg.touched = trio.current_time()
        if lac > seg.lac:
            seg.lac = lac
        counters = self._counters
        counters.bytes_written += pos - start
        counters.entries_written += eid - entry_id
        if checkpoints:
            self._write_checkpoints(seg, checkpoints)
        if len(starts) > 2 * self._dense_window:
            drop = len(starts) - self._dense_window
            del starts[:drop]
            seg.base += drop

    def _write_checkpoints(self, seg: _Segment, checkpoints: list[tuple[int, int]]) -> None:
        try:
            os.pwrite(
                seg.idx_fd,
                encode_checkpoints(checkpoints),
                INDEX_HEADER_SIZE + seg.idx_count * INDEX_RECORD_SIZE,
            )
        except OSError as exc:  # the index is derived data: reads just scan further
            logger.warning("index write failed segment=%d error=%s", seg.id, exc)
            return
        seg.idx_count += len(checkpoints)
        if seg.sparse is not None:
            for eid, pos in checkpoints:
                seg.sparse.append(eid, pos)

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

    def _durability(self, seg: _Segment) -> AppendWaiter:
        r = self._collecting
        r.segments[seg.id] = seg  # shutdown and sync() fsync it, whatever the policy
        if self._policy == "always":
            self._flush_wanted.set()
            return AppendWaiter(r, seg)
        if self._policy == "interval":
            self._flush_wanted.set()
        return AppendWaiter(None, seg)

    # ------------------------------------------------------------------ flushing

    async def _flusher(self) -> None:
        last = -float("inf")
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted = trio.Event()
            if self._policy == "interval":
                await trio.sleep_until(last + self._interval)
                last = trio.current_time()
            with trio.CancelScope(shield=True):
                await self._flush_round()

    async def _flush_round(self) -> None:
        """Group commit: fdatasync once every file written since the previous round."""
        r = self._collecting
        self._collecting = _Round()
        segs = [s for s in r.segments.values() if not s.closed]
        sync_dir = self._dir_dirty
        self._dir_dirty = False
        if not segs and not sync_dir:
            r.finish()
            return
        for s in segs:
            s.acquire()
        # until the fsyncs are known to have succeeded, the round has failed
        r.error = OSError("flush round did not complete")
        started = time.perf_counter()
        try:
            dir_fd = self._dir_fd if sync_dir else None
            errors: list[OSError] = []
            if len(segs) <= 1:  # the common case: no nursery, one thread hop
                err = await trio.to_thread.run_sync(_fsync_many, [s.fd for s in segs], dir_fd)
                if err is not None:
                    errors.append(err)
            else:
                n = min(self._flush_threads, len(segs))

                async def sync_group(fds: list[int], dir_fd: int | None) -> None:
                    err = await trio.to_thread.run_sync(_fsync_many, fds, dir_fd)
                    if err is not None:
                        errors.append(err)

                async with trio.open_nursery() as nursery:
                    for i in range(n):
                        fds = [s.fd for s in segs[i::n]]
                        nursery.start_soon(sync_group, fds, dir_fd if i == 0 else None)
            self._counters.fsyncs += len(segs) + sync_dir
            self._counters.flush_rounds += 1
            self._counters.flush_seconds += time.perf_counter() - started
            if errors:
                r.error = errors[0]
                self._io_failed("fsync", errors[0])
                self._dir_dirty = self._dir_dirty or sync_dir
            else:
                r.error = None
        finally:
            for s in segs:
                s.release()
            r.finish()

    async def sync(self) -> None:
        """Fsync everything written so far (whatever the policy)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_running()
        r = self._collecting
        for seg in self._segments.values():
            r.segments[seg.id] = seg
        self._flush_wanted.set()
        await r.done.wait()
        if r.error is not None:
            raise BookieReadOnly(f"fsync failed: {r.error}")

    # ------------------------------------------------------------------ fencing, deletion

    async def fence(self, segment_id: int) -> int:
        """Fence the segment and return its last entry id.

        From now on :meth:`add_entry` raises SegmentFenced (recovery adds excepted).
        The flag, and the entries up to the returned id, are durable when this returns.
        An unknown segment is created fenced and empty (the fence wins over a late
        first add) and -1 is returned.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_running()
        _check_segment_id(segment_id)
        seg = self._segments.get(segment_id)
        if seg is None:
            seg = self._create_segment(segment_id)
        seg.fenced = True
        seg.touched = trio.current_time()
        last = seg.next_id - 1
        await self._persist_meta(seg)
        return last

    async def _persist_meta(self, seg: _Segment) -> None:
        if seg.meta_lock is None:
            seg.meta_lock = trio.Lock()
        async with seg.meta_lock:
            if seg.closed:
                raise SegmentNotFound(f"segment={seg.id} was deleted")
            data = encode_meta(seg.id, fenced=seg.fenced, lac=seg.lac)
            seg.acquire()
            try:
                await trio.to_thread.run_sync(self._write_meta, seg.id, seg.fd, data)
            except OSError as exc:
                raise StorageError(f"cannot persist meta of segment={seg.id}: {exc}")
            finally:
                seg.release()
            seg.meta_size = len(data)
            self._counters.fsyncs += 3

    def _write_meta(self, segment_id: int, data_fd: int, data: bytes) -> None:
        """Blocking: data fdatasync, then meta written to a temp file, fsynced, renamed
        over the old one and the directory fsynced (worker thread)."""
        os.fdatasync(data_fd)
        path = self._dir / _name(segment_id, ".meta")
        tmp = self._dir / _name(segment_id, ".meta.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        os.fsync(self._dir_fd)

    async def delete_segment(self, segment_id: int) -> None:
        """Remove the segment and its files (durably).  Unknown segments are ignored,
        so that a retried delete succeeds."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_running()
        seg = self._segments.pop(segment_id, None)
        if seg is None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        seg.closed = seg.deleted = True
        with trio.CancelScope(shield=True):
            await seg.wait_idle()
            os.close(seg.fd)
            os.close(seg.idx_fd)
            await trio.to_thread.run_sync(self._unlink_segment, segment_id)
        self._counters.fsyncs += 1
        logger.info("segment deleted segment=%d", segment_id)

    def _unlink_segment(self, segment_id: int) -> None:
        # The data file goes first: without it the segment does not exist, and
        # recovery removes index or meta files left behind by a crash.
        for suffix in (".log", ".idx", ".meta"):
            (self._dir / _name(segment_id, suffix)).unlink(missing_ok=True)
        try:
            os.fsync(self._dir_fd)
        except (OSError, ValueError, TypeError):
            # the store closed meanwhile (shutdown): the unlinks stand; a crash before
            # the directory sync leaves files recovery removes again
            logger.info("segment delete not synced (store closing) segment=%d", segment_id)

    # ------------------------------------------------------------------ reads

    def _get(self, segment_id: int) -> _Segment:
        self._check_running()
        seg = self._segments.get(segment_id)
        if seg is None:
            raise SegmentNotFound(f"segment={segment_id} not found")
        return seg

    def read_entries(
        self,
        segment_id: int,
        first: int,
        last: int,
        *,
        max_bytes: int = 8 << 20,
        max_count: int = 10000,
    ) -> list[tuple[int, bytes]]:
        """Entries ``first..last`` (inclusive) as ``(entry_id, payload)``, verified.

        Ids the segment does not hold (skipped by the writer: striping, a replacement
        bookie) are left out: the entry ids returned tell which ones these are.  Stops
        early after the last stored entry, before ``max_bytes`` of payload would be
        exceeded (one entry is always returned), at ``max_count`` ids, or before an
        entry that is damaged or may have been lost with damaged bytes.  Raises
        SegmentNotFound, EntryNotFound (``first`` is not stored), CorruptEntry
        (``first`` is damaged: it is never returned) or InvalidArgument (``last <
        first``).

        Runs in the calling (trio) thread: ``os.pread`` + CRC32C at several GB/s from
        the page cache, so an 8 MiB read holds the event loop a few ms (longer when it
        hits the disk).  :meth:`read_entries_async` moves large reads to a thread.
        """
        seg, last, max_count = self._read_check(segment_id, first, last, max_count)
        while True:
            job, _span, cp_id = self._read_job(seg, first, last, max_bytes, max_count)
            entries = self._read_done(seg, first, cp_id, job())
            if entries is not None:
                return entries

    async def read_entries_async(
        self,
        segment_id: int,
        first: int,
        last: int,
        *,
        max_bytes: int = 8 << 20,
        max_count: int = 10000,
    ) -> list[tuple[int, bytes]]:
        """:meth:`read_entries`, with reads of more than ``inline_read_bytes`` (and
        every read through the sparse index) done in a worker thread."""
        await trio.lowlevel.checkpoint_if_cancelled()
        seg, last, max_count = self._read_check(segment_id, first, last, max_count)
        while True:
            job, span, cp_id = self._read_job(seg, first, last, max_bytes, max_count)
            if span <= self._inline_read:
                result = job()
                await trio.lowlevel.cancel_shielded_checkpoint()
            else:
                seg.acquire()
                try:
                    result = await trio.to_thread.run_sync(job)
                finally:
                    seg.release()
            entries = self._read_done(seg, first, cp_id, result)
            if entries is not None:
                return entries

    def _read_check(
        self, segment_id: int, first: int, last: int, max_count: int
    ) -> tuple[_Segment, int, int]:
        seg = self._get(segment_id)
        if first < 0 or last < first:
            raise InvalidArgument(f"bad entry range {first}..{last}")
        if first >= seg.next_id:
            raise EntryNotFound(
                f"segment={segment_id} entry={first} not stored (last={seg.next_id - 1})"
            )
        if first in seg.corrupt:
            raise self._corrupt(seg, first)
        last = min(last, seg.next_id - 1)
        return seg, last, max(1, min(max_count, last - first + 1))

    def _read_job(
        self, seg: _Segment, first: int, last: int, max_bytes: int, max_count: int
    ) -> tuple[Callable[[], tuple[list[tuple[int, bytes]], int, bool]], int, int]:
        """``(job, span, cp_id)``: the blocking read to run (safe in a worker thread:
        it touches no shared state), an estimate of its bytes, and the checkpoint it
        starts from (-1 when it starts at ``first``, from the dense positions)."""
        read = functools.partial(_pread, seg.fd)
        if first >= seg.base:
            starts, n = seg.starts, len(seg.starts)
            lo = first - seg.base
            pos = starts[lo]
            if pos == (starts[lo + 1] if lo + 1 < n else seg.end):
                # a zero-length span: an id skipped by the writer (ids lost with damage
                # have one too, but _read_check raised CorruptEntry for those)
                raise EntryNotFound(f"segment={seg.id} entry={first} not stored")
            hi = lo + max_count  # exclusive index of the entries wanted (<= n)
            end = starts[hi] if hi < n else seg.end
            if end - pos > max_bytes:
                stop = max(bisect_right(starts, pos + max_bytes, lo + 1, hi) - 1, lo + 1)
                end = starts[stop] if stop < n else seg.end
                last = seg.base + stop - 1
            job = functools.partial(
                collect_entries,
                read,
                seg.id,
                pos,
                first,
                end,
                first,
                last,
                max_bytes=max_bytes,
                max_count=max_count,
                chunk=self._read_chunk,
            )
            _read_ahead(seg.fd, end, seg.end)
            return job, end - pos, -1
        sparse = self._sparse_index(seg)
        cp_id, cp_pos = sparse.lookup(first)
        job = functools.partial(
            collect_entries,
            read,
            seg.id,
            cp_pos,
            cp_id,
            seg.end,
            first,
            last,
            max_bytes=max_bytes,
            max_count=max_count,
            chunk=max(self._read_chunk, min(2 * self._index_interval, 4 << 20)),
            # entry 0's header may be damaged: then resync from the start of the file
            exact_start=cp_id != 0,
        )
        return job, 1 << 62, cp_id

    def _read_done(
        self,
        seg: _Segment,
        first: int,
        cp_id: int,
        result: tuple[list[tuple[int, bytes]], int, bool],
    ) -> list[tuple[int, bytes]] | None:
        """The entries read, or None to retry (a checkpoint did not match the data)."""
        entries, corrupt, start_ok = result
        if not start_ok:
            if cp_id < 0:  # the record at first's known position is damaged
                raise self._corrupt(seg, first)
            logger.warning("dropping index checkpoint segment=%d entry=%d", seg.id, cp_id)
            self._sparse_index(seg).discard(cp_id)
            return None
        if corrupt >= 0:
            raise self._corrupt(seg, corrupt)
        if not entries:
            raise EntryNotFound(f"segment={seg.id} entry={first} not stored")
        self._counters.entries_read += len(entries)
        self._counters.bytes_read += sum(len(p) for _, p in entries)
        return entries

    def _sparse_index(self, seg: _Segment) -> SparseIndex:
        """The segment's checkpoints, read from its index file on first use."""
        if seg.sparse is None:
            try:
                buf = os.pread(seg.idx_fd, seg.idx_count * INDEX_RECORD_SIZE, INDEX_HEADER_SIZE)
            except OSError as exc:
                logger.warning("index unreadable segment=%d error=%s", seg.id, exc)
                buf = b""
            seg.sparse = SparseIndex(*decode_checkpoints(buf), next_id=seg.next_id, end=seg.end)
        return seg.sparse

    def _corrupt(self, seg: _Segment, entry_id: int) -> CorruptEntry:
        self._counters.corrupt += 1
        if entry_id not in seg.corrupt:  # logged once; later reads fail at once
            seg.corrupt.add(entry_id)  # (a repair clears it)
            logger.error(
                "damaged entry not returned segment=%d entry=%d: it failed its checksum",
                seg.id,
                entry_id,
            )
        return CorruptEntry(f"segment={seg.id} entry={entry_id} failed its checksum")

    # ------------------------------------------------------------------ queries

    def last_entry_id(self, segment_id: int) -> int:
        """Last entry id stored, -1 if none."""
        return self._get(segment_id).next_id - 1

    def read_lac(self, segment_id: int) -> int:
        """The highest last-add-confirmed the writer piggybacked on its adds (-1: none)."""
        return self._get(segment_id).lac

    def segment_info(self, segment_id: int) -> SegmentInfo:
        seg = self._get(segment_id)
        return SegmentInfo(
            segment_id=seg.id,
            last_entry_id=seg.next_id - 1,
            lac=seg.lac,
            fenced=seg.fenced,
            size_bytes=seg.end,
            entry_count=seg.next_id,
            corrupt_entries=len(seg.corrupt),
        )

    def segments(self) -> list[int]:
        """Ids of the stored segments, ascending."""
        self._check_running()
        return sorted(self._segments)

    def idle_time(self, segment_id: int) -> float:
        """Seconds (trio clock) since the segment was created, last added to or fenced.

        For a segment found at start, the clock starts at the mtime of its files: the
        time of its last write before the restart.
        """
        return max(0.0, trio.current_time() - self._get(segment_id).touched)

    def statistics(self) -> StoreStatistics:
        c = self._counters
        return StoreStatistics(
            segments=len(self._segments),
            entries_written=c.entries_written,
            bytes_written=c.bytes_written,
            entries_read=c.entries_read,
            bytes_read=c.bytes_read,
            fsyncs=c.fsyncs,
            flush_seconds=c.flush_seconds,
            flush_rounds=c.flush_rounds,
            disk_usage_bytes=sum(s.disk_usage() for s in self._segments.values()),
            corrupt_entries_detected=c.corrupt,
            read_only=self._read_only is not None,
            read_only_reason=self._read_only or "",
            damaged_entries=sum(len(s.corrupt) for s in self._segments.values()),
            torn_tails=c.torn_tails,
            torn_entries=c.torn_entries,
            repaired_entries=c.repaired,
        )


def _check_segment_id(segment_id: int) -> None:
    if not 0 <= segment_id <= _MAX_SEGMENT_ID:
        raise InvalidArgument(f"segment id out of range: {segment_id}")


def _checkpoint_valid(read: ReadFn, segment_id: int, entry_id: int, pos: int, size: int) -> bool:
    if not FILE_HEADER_SIZE <= pos <= size - RECORD_HEADER_SIZE or entry_id < 0:
        return False
    h = parse_record_header(read(pos, RECORD_HEADER_SIZE), 0)
    return h is not None and h[1] == segment_id and h[2] == entry_id
