"""SegmentStore: the storage engine of a bookie.

One append-only data file per segment, a sparse index beside it and a small meta file
(fenced flag, lac).  Byte layouts: :mod:`pigeon.bookie._segment` and
:mod:`pigeon.bookie._index` (and the package README, "On-disk format").

Entry ids grow but may skip: a bookie of a striped ensemble (E > Qw) stores only the
entries whose write set includes it, and a bookie that replaced a failed one starts
mid-segment.  An id the writer skipped is *not stored* (EntryNotFound, and left out of
range reads); an id that damaged bytes may have held is *corrupt* (CorruptEntry).

The store is layered, one concern a module: :mod:`~pigeon.bookie._storage_state` (the
configuration, the in-memory state of the segments, file names, the read-only state),
:mod:`~pigeon.bookie._storage_reads` (range reads), :mod:`~pigeon.bookie._storage_recovery`
(opening the directory, recovery, repair), :mod:`~pigeon.bookie._storage_commit` (group
commit), :mod:`~pigeon.bookie._storage_writes` (appends); this module puts them together
with the lifecycle, fencing, deletion and the queries.

Write path (trio thread, per entry): one ``os.pwritev`` of ``[header, payload]`` at the
known end of the file (the payload is the caller's buffer as it is: the memoryview of a
received frame is written without a copy, see :mod:`~pigeon.bookie._storage_writes`),
then an append to the in-memory position list (a skipped id gets a zero-length span
there; a jump over more than the dense window restarts it).  Durability is the
flusher's job (group commit): every flush round takes the set of files written since
the previous round and ``fdatasync``\\ s each once, in worker threads, while new
appends go on into the next round.  Under ``always`` an add returns after the round
covering it; under ``interval`` rounds run every ``fsync_interval_ms`` and adds return
after the write; under ``never`` only :meth:`SegmentStore.sync`, a fence and shutdown
fsync.

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

import os
import time

import trio

from pigeon.bookie._segment import encode_meta
from pigeon.bookie._storage_commit import AppendWaiter
from pigeon.bookie._storage_state import (
    FsyncPolicy,
    SegmentInfo,
    SegmentState,
    StoreStatistics,
    check_segment_id,
    file_name,
    logger,
)
from pigeon.bookie._storage_writes import StoreWrites
from pigeon.core.errors import SegmentNotFound, StorageError

__all__ = ["AppendWaiter", "FsyncPolicy", "SegmentInfo", "SegmentStore", "StoreStatistics"]


class SegmentStore(StoreWrites):
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
    ``page_cache_window_bytes``: of each segment file, the most recent bytes written
    that stay in the page cache once durable; older pages are dropped after the flush
    round that made them durable (:func:`~pigeon.bookie._storage_state.drop_behind`;
    -1: never, the kernel decides; under ``fsync=never`` only :meth:`sync`, fences
    and shutdown drop, as only they fsync).
    """

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
        check_segment_id(segment_id)
        seg = self._segments.get(segment_id)
        if seg is None:
            seg = self._create_segment(segment_id)
        seg.fenced = True
        seg.touched = trio.current_time()
        last = seg.next_id - 1
        await self._persist_meta(seg)
        return last

    async def _persist_meta(self, seg: SegmentState) -> None:
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
        path = self._dir / file_name(segment_id, ".meta")
        tmp = self._dir / file_name(segment_id, ".meta.tmp")
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
            (self._dir / file_name(segment_id, suffix)).unlink(missing_ok=True)
        try:
            os.fsync(self._dir_fd)
        except (OSError, ValueError, TypeError):
            # the store closed meanwhile (shutdown): the unlinks stand; a crash before
            # the directory sync leaves files recovery removes again
            logger.info("segment delete not synced (store closing) segment=%d", segment_id)

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
