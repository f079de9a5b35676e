"""JournalStore: the ``journal`` ledger storage, in BookKeeper's shape.

Three parts, on disks of their choosing (``journal_directory``, ``ledger_directories``):

* **The journal** (:mod:`~pigeon.bookie._journal_file`): every add of every segment,
  every fence and every deletion is appended to one journal file, in the trio thread,
  and made durable by the group commit: each round ``fdatasync``\\ s the journal once
  for all the adds since the previous round (``fsync=always``: an add's waiter
  completes after the round covering it; ``interval``: rounds every
  ``fsync_interval_ms``; ``never``: only :meth:`JournalStore.sync`, fences, deletions
  and shutdown).  ``journal_max_group_wait_ms`` holds a round back to gather more adds.
  That fsync is the only one on the ack path, whatever the number of segments written:
  the point of this backend (many topics share one fsync).
* **Entry logs** (:mod:`~pigeon.bookie._journal_logs`): each add is also written to
  the current entry log (interleaved segments, rolled at ``entry_log_size_limit``),
  which reads use: with ``fsync=always`` by the round, in a worker thread beside the
  journal's fdatasync (until then reads take the entry from ``_unwritten``, memory).
  They are fsynced by the checkpoint, never on the ack path.
* **The index** (:mod:`~pigeon.bookie._journal_index`, LMDB): (segment, entry) ->
  (log, offset, length) and each segment's state (next id, lac, fenced, size).  The
  entries written since the last checkpoint are found in memory.

**Checkpoint** (every ``flush_interval_ms``, or after ``flush_entries`` adds): the
entry logs written since the previous one are fsynced (the write-behind had them
written every ``flush_entrylog_bytes``, so little is left), the new index entries and
segment states committed in one LMDB transaction with the journal position they
cover, and the journal files wholly before that position deleted.

**Page cache** (:func:`~pigeon.bookie._storage_state.drop_behind`): the journal's
pages are dropped once a round made them durable (``journal_remove_pages_from_cache``,
BookKeeper's ``journalRemovePagesFromCache``: only a replay reads the journal), and an
entry log's once written behind, but for its last ``page_cache_window_bytes`` (-1:
kept, the kernel decides), so that written data does not keep growing the page cache.

**Replay** at start: the records of the journal after the checkpointed position are
re-applied in order (entries written to a new entry log, fences, deletions); the first
torn record (short, or failing its crc) ends the replay and is cut off; then a
checkpoint makes the replay's result the index's.

**Reads** (:mod:`~pigeon.bookie._journal_reads`) verify every record; a damaged entry
raises CorruptEntry.  A recovery add of an entry stored damaged writes the good copy
anew (journal and entry log) and the index points at it from then on.

**Deletion** writes a delete record to the journal (durable), then drops the segment's
index entries in one LMDB transaction.  **Compaction** rewrites the live records of
the entry logs whose live bytes fell below a threshold of their size
(``minor_compaction_threshold`` every ``minor_compaction_interval_s``,
``major_compaction_threshold`` every ``major_compaction_interval_s``: BookKeeper's
minor and major compaction) into a new log, repoints the index and deletes the old
logs; a log with no live record left is deleted at the next checkpoint.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import trio

from pigeon.bookie._journal_file import JournalFile
from pigeon.bookie._journal_format import (
    DELETE,
    ENTRY,
    FENCE,
    FILE_HEADER_SIZE,
    LOG_MAGIC,
    RECORD_HEADER_SIZE,
    encode_control,
    encode_entry_header,
    encode_file_header,
    parse_header,
)
from pigeon.bookie._journal_index import LedgerIndex, Loc, SegmentRecord
from pigeon.bookie._journal_logs import EntryLog, LogWrite, write_behind, write_reserved
from pigeon.bookie._journal_reads import JournalReads
from pigeon.bookie._journal_state import JournalRound, Seg, logger
from pigeon.bookie._segment import MAX_PAYLOAD, Buffer, crc32c
from pigeon.bookie._storage_commit import AppendWaiter, fsync_many
from pigeon.bookie._storage_state import (
    MAX_ENTRY_ID,
    DropBehind,
    as_buffer,
    check_segment_id,
    next_drop,
    stored_damaged,
)
from pigeon.core.errors import (
    BookieReadOnly,
    DataDirLocked,
    InvalidArgument,
    InvalidEntryId,
    SegmentFenced,
    StorageError,
)
from pigeon.core.storage import SegmentInfo, StoreStatistics

__all__ = ["JOURNAL_FORMAT", "JournalStore"]

#: a round's entry-log bytes from which they are written in a thread of their own,
#: beside the journal's fdatasync (below, the same thread writes them first: a thread
#: hop costs more than the copy)
_PARALLEL_LOG_BYTES = 256 << 10

#: fsync=never/interval: entry-log bytes reserved before they are written at once (in
#: the trio thread, one vectored write), not left to the next round
_LOG_BATCH_BYTES = 64 << 10

#: the first line of the FORMAT file of a data dir the journal storage owns
JOURNAL_FORMAT = b"pigeon-journal 1\n"


class JournalStore(JournalReads):
    """The segments of one bookie in a journal, entry logs and an LMDB index.

    Start it with ``await nursery.start(store.run)``; every other method may be called
    only while :meth:`run` runs (else ServiceUnavailable), from trio tasks of one run.
    See the module documentation for the options.
    """

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the index, replay the journal, then serve until cancelled.  On exit
        (shielded) the journal is fsynced, a checkpoint taken and the files closed."""
        if self._state != "new":
            raise RuntimeError("a JournalStore runs only once")
        self._state = "starting"
        try:
            await trio.to_thread.run_sync(self._open)
        except BaseException as exc:
            self._close_all()
            self._state = "closed"
            if isinstance(exc, OSError):  # a file where a directory goes, a failing disk
                raise StorageError(f"cannot open the journal store: {exc}") from None
            raise
        now, wall = trio.current_time(), time.time()
        for seg in self._segs.values():  # wall clock -> trio clock
            seg.touched = now - max(0.0, wall - seg.touched)
        self._state = "running"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._flusher)
                nursery.start_soon(self._checkpointer)
                nursery.start_soon(self._write_behind)
                nursery.start_soon(self._compactor)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self._shutdown()

    def _open(self) -> None:
        """Blocking: lock the directories, open the index, the entry logs and the
        journal, replay it and checkpoint the result (worker thread)."""
        for d in [self._journal_dir, *self._ledger_dirs]:
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(d / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._lock_fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DataDirLocked(
                    f"directory {d} is in use by another bookie or standalone: stop it,"
                    " or use another data directory"
                ) from None
        self._claim_format()
        self._index = index = LedgerIndex(
            self._ledger_dirs[0] / "index", map_size=self._index_map_size
        )
        checkpoint = index.checkpoint()
        for sid, state in index.load_segments().items():
            self._segs[sid] = Seg(
                sid,
                next_id=state.next_id,
                lac=state.lac,
                fenced=state.fenced,
                size_bytes=state.size_bytes,
                touched=state.touched_wall,
            )
        self._logs.open()
        files = self._journal.open_files()
        if checkpoint is None:
            self._check_index_not_lost(files)
        mtime = max((os.fstat(f.fd).st_mtime for f in files), default=time.time())
        deleted: set[int] = set()
        replayed = 0
        for rec in self._journal.replay(checkpoint):
            replayed += 1
            seg = self._segs.get(rec.segment_id)
            if rec.kind == DELETE:
                if seg is not None:
                    del self._segs[rec.segment_id]
                deleted.add(rec.segment_id)
                self._dirty.discard(rec.segment_id)
                continue
            if seg is None:
                seg = self._segs[rec.segment_id] = Seg(rec.segment_id)
            seg.touched = mtime
            self._dirty.add(seg.id)
            if rec.kind == FENCE:
                seg.fenced = True
                continue
            assert rec.kind == ENTRY
            header = encode_entry_header(seg.id, rec.entry_id, rec.lac, rec.payload)
            log_id, offset = self._logs.write([header, rec.payload], rec.size)
            self._apply(seg, rec.entry_id, Loc(log_id, offset, rec.size), rec.lac)
        self._counters.torn_tails = self._journal.torn_tails
        self._counters.torn_entries = self._journal.torn_tails
        if replayed:
            logger.info("journal replayed records=%d segments=%d", replayed, len(self._dirty))
        self._journal.start_new_file()
        self._journal.sync_dir()
        # the replay's result becomes the index's; the old journal files go
        snap = [seg for seg in self._segs.values() if seg.recent]
        for seg in snap:
            seg.indexing, seg.recent = seg.recent, {}
        logs, dirs = self._logs.take_dirty()
        self._commit(snap, self._states(self._dirty), logs, dirs, self._journal.position(), deleted)
        for seg in snap:
            seg.indexing = None
        self._dirty.clear()
        self._pending = 0
        for jf in self._journal.delete_before(self._journal.position()[0]):
            os.close(jf.fd)
            jf.path.unlink(missing_ok=True)

    def _check_index_not_lost(self, files: list[JournalFile]) -> None:
        """An index without a checkpoint is new, unless the journal was already cut by
        a checkpoint (its first file is not the first one ever) or, the journal gone,
        entry logs hold records: then the index was lost, and starting would forget
        every segment it held (and delete the entry logs nothing points into)."""
        first = min((jf.seq for jf in files), default=None)
        written = any(log.end > FILE_HEADER_SIZE for log in self._logs.logs.values())
        if (first is not None and first > 0) or (first is None and written):
            raise StorageError(
                f"the index {self._ledger_dirs[0] / 'index'} is missing or empty, but the"
                " journal and entry logs were written under one: restore it (starting"
                " without it would lose every segment)"
            )

    def _apply(self, seg: Seg, entry_id: int, loc: Loc, lac: int) -> None:
        """An entry record written at ``loc``: above the last id an append, below it a
        copy superseding a damaged one."""
        if entry_id >= seg.next_id:
            seg.next_id = entry_id + 1
            seg.size_bytes += loc.length
        else:
            seg.corrupt.discard(entry_id)
        seg.recent[entry_id] = loc
        if lac > seg.lac:
            seg.lac = lac

    async def _shutdown(self) -> None:
        self._state = "closing"
        try:
            await self._flush_round()
            if self._checkpoint_on_close:
                async with self._index_lock:
                    await self._checkpoint_locked()
        except (StorageError, OSError) as exc:
            logger.warning("no checkpoint at shutdown (the journal is replayed): %s", exc)
        finally:
            self._close_all()
            self._state = "closed"

    def _close_all(self) -> None:
        self._journal.close()
        self._logs.close()
        if self._index is not None:
            self._index.close()
            self._index = None
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds = []

    # ------------------------------------------------------------------ appends

    def append(
        self, segment_id: int, entry_id: int, data: Buffer, *, lac: int = -1, recovery: bool = False
    ) -> AppendWaiter:
        """Write entry ``entry_id`` now (journal and entry log, page cache); the
        waiter tells when it is durable per the fsync policy.

        Ids grow and may skip; the first add creates the segment.  ``recovery=True``
        is BookKeeper's recovery add: accepted on a fenced segment; an entry already
        stored with identical bytes is not written again; one stored damaged is
        written anew and the index points at the new copy.  Raises at once
        InvalidEntryId, SegmentFenced, BookieReadOnly, InvalidArgument,
        ServiceUnavailable."""
        self._check_running()
        payload = as_buffer(data)
        if recovery:
            seg = self._segs.get(segment_id)
            if seg is not None and 0 <= entry_id < seg.next_id:
                if stored_damaged(
                    self.read_entries, segment_id, entry_id, seg.next_id - 1, payload
                ):
                    self._check_writable()
                    if not self._belongs(seg, entry_id, payload):
                        raise InvalidEntryId(
                            f"segment={segment_id} entry={entry_id} is stored damaged and"
                            " these bytes are not its copy (other length or checksum)"
                        )
                    self._write(seg, entry_id, [payload], lac)
                    self._counters.repaired += 1
                    logger.warning(
                        "damaged entry rewritten from a good copy segment=%d entry=%d",
                        segment_id,
                        entry_id,
                    )
                return self._durability(seg)
        seg = self._segment_for_append(segment_id, entry_id, lac, recovery)
        self._write(seg, entry_id, [payload], lac)
        return self._durability(seg)

    async def add_entry(
        self, segment_id: int, entry_id: int, data: Buffer, *, lac: int = -1, recovery: bool = False
    ) -> None:
        """:meth:`append`, then wait until durable (cancelled meanwhile, the entry
        stays written: the writer must treat it as not acknowledged)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        await self.append(segment_id, entry_id, data, lac=lac, recovery=recovery).wait()

    async def add_entries(
        self,
        segment_id: int,
        first_entry_id: int,
        entries: Sequence[Buffer],
        *,
        lac: int = -1,
        recovery: bool = False,
    ) -> None:
        """Append ``entries`` as consecutive ids from ``first_entry_id``: one journal
        write, one entry-log write, one durability wait."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_running()
        payloads = [as_buffer(d) for d in entries]
        if not payloads:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        seg = self._segment_for_append(segment_id, first_entry_id, lac, recovery)
        self._write(seg, first_entry_id, payloads, lac)
        await self._durability(seg).wait()

    def _check_writable(self) -> None:
        if self._read_only is not None:
            raise BookieReadOnly(f"bookie is read-only: {self._read_only}")

    def _claim_format(self) -> None:
        """The data dir's FORMAT file says which storage owns it: a segment-files data
        dir is refused (its segments would look lost), a new one is marked journal."""
        root = self._format_root
        if root is None:
            return
        root.mkdir(parents=True, exist_ok=True)
        fmt = root / "FORMAT"
        if fmt.exists() and fmt.stat().st_size:
            if fmt.read_bytes() != JOURNAL_FORMAT:
                head = fmt.read_bytes()[:80].split(b"\n", 1)[0].decode("ascii", "replace")
                raise StorageError(
                    f"{root} holds another ledger storage ({head!r}), not journal: start"
                    " the bookie with the storage that wrote it"
                )
            return
        tmp = fmt.with_suffix(".tmp")
        tmp.write_bytes(JOURNAL_FORMAT)
        os.replace(tmp, fmt)

    def _belongs(self, seg: Seg, entry_id: int, payload: Buffer) -> bool:
        """Are ``payload`` provably the bytes of the damaged entry ``entry_id``?  Its
        record's length (from the index) must match and, when the record's header is
        still intact, the payload checksum the header holds: a repair never writes
        other bytes over an entry."""
        found = self._locate(seg, entry_id, entry_id, 1)
        if not found or found[0][0] != entry_id:
            return False
        loc = found[0][1]
        if loc.length - RECORD_HEADER_SIZE != len(payload):
            return False
        log = self._logs.logs.get(loc.log)
        if log is None:
            return True  # the log is gone: the length is all there is to check
        header = parse_header(os.pread(log.fd, RECORD_HEADER_SIZE, loc.offset), 0)
        if header is None:
            return True  # the header is damaged too: the length matched
        _kind, length, sid, eid, _lac, pcrc = header
        return (sid, eid, length) == (seg.id, entry_id, len(payload)) and crc32c(payload) == pcrc

    def _segment_for_append(self, segment_id: int, entry_id: int, lac: int, recovery: bool) -> Seg:
        check_segment_id(segment_id)
        if not 0 <= entry_id <= MAX_ENTRY_ID:
            raise InvalidEntryId(f"entry id out of range: {entry_id}")
        if not -1 <= lac <= MAX_ENTRY_ID:
            raise InvalidArgument(f"lac out of range: {lac}")
        self._check_writable()
        seg = self._segs.get(segment_id)
        if seg is None:
            seg = self._segs[segment_id] = Seg(segment_id, touched=trio.current_time())
        if seg.fenced and not recovery:
            raise SegmentFenced(f"segment={segment_id} is fenced")
        if entry_id < seg.next_id:
            raise InvalidEntryId(
                f"segment={segment_id} entry {entry_id} is not above the last entry"
                f" {seg.next_id - 1}"
            )
        return seg

    def _write(self, seg: Seg, entry_id: int, payloads: list[Buffer], lac: int) -> None:
        """Journal and entry log, one ``pwritev`` each for the whole batch."""
        bufs: list[Buffer] = []
        eid = entry_id
        for payload in payloads:
            if len(payload) > MAX_PAYLOAD:
                raise InvalidArgument(f"entry of {len(payload)} bytes is too large")
            bufs.append(encode_entry_header(seg.id, eid, lac, payload))
            bufs.append(payload)
            eid += 1
        total = len(payloads) * RECORD_HEADER_SIZE + sum(len(p) for p in payloads)
        try:
            jf = self._journal.write(bufs, total)
        except OSError as exc:
            raise self._io_failed(f"write journal segment={seg.id} entry={entry_id}", exc)
        r = self._collecting
        r.files[jf.seq] = jf
        r.journal_bytes += total
        # The entry log is written later, reads take the entry from memory meanwhile
        # (``_unwritten``): fsync=always: by the round, in a worker thread while the
        # journal's fdatasync runs (the event loop copies the bytes once, not twice);
        # the other policies: by the next round (a checkpoint, a sync, a fence, the
        # interval) or once _LOG_BATCH_BYTES are due, here, in one vectored write for
        # all (not one write per add beside the journal's)
        try:
            log, pos = self._logs.reserve(total)
        except OSError as exc:
            raise self._io_failed(f"write entry log segment={seg.id} entry={entry_id}", exc)
        log_id = log.id
        r.log_writes.append((log, pos, bufs, total))
        r.log_bytes += total
        unwritten = self._unwritten
        eid = entry_id
        for payload in payloads:
            size = RECORD_HEADER_SIZE + len(payload)
            self._apply(seg, eid, Loc(log_id, pos, size), lac)
            unwritten[log_id, pos] = payload
            pos += size
            eid += 1
        if r.log_bytes >= _LOG_BATCH_BYTES and self._policy != "always":
            writes, r.log_writes, r.log_bytes = r.log_writes, [], 0
            self._logs_done(writes, write_reserved(writes))
        seg.touched = trio.current_time()
        self._dirty.add(seg.id)
        c = self._counters
        c.bytes_written += total
        c.entries_written += len(payloads)
        self._pending += len(payloads)
        if self._pending >= self._flush_entries:
            self._checkpoint_wanted.set()
        self._want_write_behind()

    def _want_write_behind(self) -> None:
        """Wake the write-behind task if an entry log has enough written for it."""
        if self._logs.write_behind_due:
            self._write_behind_wanted.set()
            if self._written_behind.is_set():
                self._written_behind = trio.Event()

    def _write_control(self, kind: int, seg_id: int) -> None:
        record = encode_control(kind, seg_id)
        try:
            jf = self._journal.write([record], len(record))
        except OSError as exc:
            raise StorageError(f"cannot write the journal: {exc.strerror or exc}")
        self._collecting.files[jf.seq] = jf
        self._collecting.journal_bytes += len(record)
        self._counters.bytes_written += len(record)

    # ------------------------------------------------------------------ group commit

    def _durability(self, seg: Seg) -> AppendWaiter:
        if self._policy == "always":
            self._flush_wanted.set()
            return AppendWaiter(self._collecting, seg)
        if self._policy == "interval":
            self._flush_wanted.set()
        return AppendWaiter(None, seg)

    async def _flusher(self) -> None:
        last = -float("inf")
        self._flusher_running = True
        try:
            while True:
                await self._flush_wanted.wait()
                self._flush_wanted = trio.Event()
                if self._policy == "interval":
                    await trio.sleep_until(last + self._interval)
                    last = trio.current_time()
                elif self._group_wait > 0:
                    await trio.sleep(self._group_wait)
                with trio.CancelScope(shield=True):
                    await self._flush_round()
        finally:
            # stopping: the round being collected may have waiters (a shielded
            # checkpoint's _force_round): it is flushed here, later ones directly
            self._flusher_running = False
            with trio.CancelScope(shield=True):
                await self._flush_round()

    async def _flush_round(self) -> None:
        """Group commit: fdatasync the journal files written since the previous round
        (one, unless it rolled), and the journal directory if a file was created.

        Rounds run one at a time, each after the previous one ended (its entry-log
        writes included): a round forced while another is in flight (stopping, the
        flusher gone: a sync, a fence, the checkpoint) waits for it, so that the
        checkpoint never fsyncs the entry logs, nor the store closes them, under a
        round still writing them."""
        async with self._round_lock:
            await self._flush_round_locked()

    async def _flush_round_locked(self) -> None:
        r = self._collecting
        self._collecting = JournalRound()
        files = list(r.files.values())
        sync_dir = self._journal.dir_dirty
        self._journal.dir_dirty = False
        if not files and not sync_dir:
            r.finish()
            return
        r.error = OSError("flush round did not complete")
        started = time.perf_counter()
        try:
            dir_fd = self._journal.dir_fd if sync_dir else None
            fds = [f.fd for f in files]
            writes = r.log_writes
            nbytes = sum(w[3] for w in writes)
            if not sync_dir and self._inline.allowed(max(nbytes, r.journal_bytes)):
                # small, on a fast disk: here, without the two thread hops (and without
                # dropping pages: ~0.2 ms per 4 MiB on the loop; a thread round drops
                # what the inline ones left)
                t = time.perf_counter()
                log_err, err = _round_io(writes, fds, dir_fd, [])
                self._inline.ran(time.perf_counter() - t)
                self._counters.inline_rounds += 1
                if writes:
                    self._logs_done(writes, log_err)
            elif nbytes >= _PARALLEL_LOG_BYTES:
                # a long copy: beside the fdatasync, in a thread of its own
                drops = self._journal_drops(files)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write_logs, writes)
                    err = await self._sync_thread.run(fsync_many, fds, dir_fd, drops)
            elif writes:  # a short one: before it, in the same thread (one hop)
                drops = self._journal_drops(files)
                log_err, err = await self._sync_thread.run(_round_io, writes, fds, dir_fd, drops)
                self._logs_done(writes, log_err)
            else:
                err = await self._sync_thread.run(
                    fsync_many, fds, dir_fd, self._journal_drops(files)
                )
            c = self._counters
            c.fsyncs += len(files) + sync_dir
            c.flush_rounds += 1
            c.flush_seconds += time.perf_counter() - started
            if err is not None:
                r.error = err
                self._io_failed("fsync", err)
                self._journal.dir_dirty = self._journal.dir_dirty or sync_dir
            else:
                r.error = None
        finally:
            r.finish()

    def _journal_drops(self, files: list[JournalFile]) -> list[DropBehind]:
        """What a round's fdatasync in the sync thread makes droppable from the page
        cache: the journal files' bytes written so far (all in this round; BookKeeper's
        ``journalRemovePagesFromCache``: the journal is read only by a replay), a few
        MiB at a time at least."""
        if not self._remove_journal_pages:
            return []
        drops = (next_drop(jf, jf.end, 0) for jf in files)
        return [d for d in drops if d is not None]

    async def _write_logs(self, writes: list[LogWrite]) -> None:
        """A round's entry-log writes (worker thread); the entries are read from disk
        once written, from memory until then (and for good if the write failed: they
        are in the journal, which no checkpoint may then let go)."""
        self._logs_done(writes, await self._log_thread.run(write_reserved, writes))

    def _logs_done(self, writes: list[LogWrite], err: OSError | None) -> None:
        if err is not None:
            self._failed_writes.extend(writes)  # the checkpoint tries them again
            self._io_failed("write entry log", err)
            return
        self._written(writes)

    def _written(self, writes: list[LogWrite]) -> None:
        unwritten = self._unwritten
        logs = self._logs
        for log, pos, bufs, _total in writes:
            for i in range(1, len(bufs), 2):  # header, payload, header, payload, ...
                unwritten.pop((log.id, pos), None)
                pos += len(bufs[i - 1]) + len(bufs[i])
            logs.written_up_to(log, pos)
        self._want_write_behind()

    async def _write_failed_again(self) -> None:
        """The entry-log writes that failed, tried again (a checkpoint may let the
        journal go only once every entry is in an entry log); raises StorageError."""
        # taken: a round failing meanwhile adds its writes to a new list (written by
        # the next checkpoint), not to this one after the thread went through it
        failed, self._failed_writes = self._failed_writes, []
        if failed:
            err = await trio.to_thread.run_sync(write_reserved, failed)
            if err is not None:
                self._failed_writes[:0] = failed
                raise StorageError(
                    "an entry-log write failed: the journal is kept (it is replayed at"
                    f" the next start): {err.strerror or err}"
                )
            self._written(failed)
            logger.warning("entry-log writes that had failed written again writes=%d", len(failed))

    async def _force_round(self) -> JournalRound:
        """The journal written so far, fsynced (whatever the policy)."""
        r = self._collecting
        if self._state == "running" and self._flusher_running:
            self._flush_wanted.set()
            await r.done.wait()
        else:  # the flusher is not there (starting, or stopping): flush here
            await self._flush_round()
        return r

    async def sync(self) -> None:
        """Fsync everything written so far (whatever the policy)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_running()
        r = await self._force_round()
        if r.error is not None:
            raise BookieReadOnly(f"fsync failed: {r.error}")

    # ------------------------------------------------------------------ fencing, deletion

    async def fence(self, segment_id: int) -> int:
        """Fence the segment and return its last entry id; the flag and the entries up
        to it are durable when this returns.  An unknown segment is created fenced and
        empty (-1)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_running()
        check_segment_id(segment_id)
        seg = self._segs.get(segment_id)
        if seg is None:
            seg = self._segs[segment_id] = Seg(segment_id)
        if not seg.fenced:
            self._write_control(FENCE, segment_id)
            seg.fenced = True
            self._dirty.add(segment_id)
        seg.touched = trio.current_time()
        last = seg.next_id - 1
        r = await self._force_round()
        if r.error is not None:
            raise StorageError(f"cannot persist the fence of segment={segment_id}: {r.error}")
        return last

    async def delete_segment(self, segment_id: int) -> None:
        """Remove the segment: a delete record in the journal (fsynced), then its index
        entries dropped (one LMDB transaction); its records in the entry logs go with
        compaction.  Unknown segments are ignored (a retried delete succeeds)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_running()
        if segment_id not in self._segs:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        with trio.CancelScope(shield=True):
            async with self._index_lock:
                seg = self._segs.get(segment_id)
                if seg is None:
                    return
                self._write_control(DELETE, segment_id)
                del self._segs[segment_id]
                seg.deleted = True
                self._dirty.discard(segment_id)
                r = await self._force_round()
                if r.error is not None:
                    raise StorageError(f"cannot persist the deletion: {r.error}")
                assert self._index is not None
                index = self._index
                self._live = await trio.to_thread.run_sync(self._drop, index, segment_id)
                self._counters.fsyncs += 1
        logger.info("segment deleted segment=%d", segment_id)

    @staticmethod
    def _drop(index: LedgerIndex, segment_id: int) -> dict[int, int]:
        index.delete_segment(segment_id)
        return index.load_live()

    # ------------------------------------------------------------------ checkpoints

    async def checkpoint(self) -> None:
        """Bring the index up to the journal now: entry logs fsynced, index committed,
        journal files before that position deleted (also done in the background every
        ``flush_interval_ms``)."""
        self._check_running()
        with trio.CancelScope(shield=True):
            async with self._index_lock:
                await self._checkpoint_locked()

    async def _checkpointer(self) -> None:
        while True:
            with trio.move_on_after(self._flush_interval):
                await self._checkpoint_wanted.wait()
            self._checkpoint_wanted = trio.Event()
            if not self._dirty:
                continue
            try:
                await self.checkpoint()
            except StorageError as exc:
                logger.error("checkpoint failed (retried): %s", exc)

    async def _write_behind(self) -> None:
        """Entry-log write-behind (see :mod:`~pigeon.bookie._journal_logs`): each time a
        log has ``flush_entrylog_bytes`` written since the last, have them written to
        disk in a worker thread, so that the checkpoint's fdatasync finds little dirty
        and the journal's fdatasyncs do not queue behind gigabytes."""
        while True:
            await self._write_behind_wanted.wait()
            self._write_behind_wanted = trio.Event()
            ranges, drops = self._logs.take_write_behind()
            try:
                if ranges:
                    await trio.to_thread.run_sync(write_behind, ranges, drops)
                    self.write_behinds += len(ranges)
            except OSError as exc:  # the checkpoint's fdatasync meets it and says so
                logger.warning("entry-log write-behind failed: %s", exc)
            finally:
                for log, _start, _end in ranges:
                    log.release()
                if not self._logs.write_behind_due:
                    self._written_behind.set()

    async def wait_written_behind(self) -> None:
        """Wait until no entry-log write-behind is due or in flight."""
        await self._written_behind.wait()

    def _states(self, sids: set[int]) -> dict[int, SegmentRecord]:
        wall, now = time.time(), (trio.current_time() if self._state != "starting" else 0.0)
        out = {}
        for sid in sids:
            seg = self._segs.get(sid)
            if seg is None:
                continue
            touched = seg.touched if self._state == "starting" else wall - (now - seg.touched)
            out[sid] = SegmentRecord(seg.next_id, seg.lac, seg.fenced, seg.size_bytes, touched)
        return out

    async def _checkpoint_locked(self) -> None:
        assert self._index is not None
        position = self._journal.position()
        dirty, self._dirty = self._dirty, set()
        snap = [s for sid in dirty if (s := self._segs.get(sid)) is not None and s.recent]
        for seg in snap:
            seg.indexing, seg.recent = seg.recent, {}
        states = self._states(dirty)
        logs, dirs = self._logs.take_dirty()
        self._pending = 0
        # rounds in flight may still fsync the journal files about to be deleted, and
        # write the entry logs about to be fsynced
        await self._force_round()
        try:
            await self._write_failed_again()
            self._live = await trio.to_thread.run_sync(
                self._commit, snap, states, logs, dirs, position, ()
            )
        except BaseException as exc:
            for seg in snap:  # the next checkpoint tries again
                assert seg.indexing is not None
                seg.indexing.update(seg.recent)
                seg.recent, seg.indexing = seg.indexing, None
            self._dirty |= {sid for sid in dirty if sid in self._segs}
            for log in logs:
                if log.id in self._logs.logs:
                    self._logs.mark_dirty(log)
            if isinstance(exc, OSError):
                raise self._io_failed("fsync", exc)
            raise
        for seg in snap:
            seg.indexing = None
        old = self._journal.delete_before(position[0])
        if old:
            await trio.to_thread.run_sync(_unlink_journals, old)
        await self._drop_empty_logs()
        self.checkpoints += 1

    def _commit(
        self,
        snap: list[Seg],
        states: dict[int, SegmentRecord],
        logs: list[EntryLog],
        dirs: list[int],
        position: tuple[int, int],
        deleted: Sequence[int] | set[int],
    ) -> dict[int, int]:
        """Blocking: entry logs fsynced, then one index transaction."""
        assert self._index is not None
        self._counters.fsyncs += self._logs.sync(logs, dirs)

        def entries() -> Iterator[tuple[int, int, Loc]]:
            for seg in snap:
                assert seg.indexing is not None
                sid = seg.id
                for eid, loc in seg.indexing.items():
                    yield sid, eid, loc

        self._index.commit(entries=entries(), states=states, deleted=deleted, checkpoint=position)
        return self._index.load_live()

    # ------------------------------------------------------------------ compaction

    async def _drop_empty_logs(self) -> None:
        """Delete the sealed, fully indexed entry logs no index entry points into."""
        gone = [
            log
            for log in self._logs.sealed()
            if not self._logs.is_dirty(log) and self._live.get(log.id, 0) == 0
        ]
        if gone:
            await self._retire(gone)

    async def _retire(self, logs: list[EntryLog]) -> None:
        for log in logs:
            self._logs.retire(log.id)
            self._live.pop(log.id, None)
        paths = [log.path for log in logs]
        await trio.to_thread.run_sync(_unlink_all, paths)
        logger.info("entry logs deleted logs=%s", [log.id for log in logs])

    async def compact(self, threshold: float | None = None) -> int:
        """Rewrite the entry logs whose live bytes are below ``threshold`` of their
        size (default: the minor compaction threshold) and delete them; returns the
        logs removed."""
        self._check_running()
        if threshold is None:
            threshold = self._minor[0]
        removed = 0
        with trio.CancelScope(shield=True):
            async with self._index_lock:
                removed = await self._compact_locked(threshold)
        return removed

    async def _compact_locked(self, threshold: float) -> int:
        assert self._index is not None
        candidates = [
            log
            for log in self._logs.sealed()
            if not self._logs.is_dirty(log) and self._live.get(log.id, 0) < threshold * log.end
        ]
        if not candidates:
            return 0
        empty = [log for log in candidates if self._live.get(log.id, 0) == 0]
        busy = [log for log in candidates if self._live.get(log.id, 0) > 0]
        if busy:
            new_id = self._logs.reserve_id()
            tmp, dir_index = self._logs.tmp_path(new_id)
            for log in busy:
                log.refs += 1
            try:
                final, moves = await trio.to_thread.run_sync(
                    self._rewrite, busy, new_id, tmp, dir_index
                )
                # the new log is readable before the index points into it
                self._logs.adopt(new_id, final, dir_index)
                index = self._index
                moved, self._live = await trio.to_thread.run_sync(
                    self._move, index, moves, [log.id for log in busy]
                )
            finally:
                for log in busy:
                    log.release()
            logger.info(
                "entry logs compacted logs=%s entries_moved=%d into=%d",
                [log.id for log in busy],
                moved,
                new_id,
            )
        await self._retire(empty + busy)
        self.compacted_logs += len(empty) + len(busy)
        return len(empty) + len(busy)

    def _rewrite(
        self, logs: list[EntryLog], new_id: int, tmp: Path, dir_index: int
    ) -> tuple[Path, list[tuple[bytes, Loc, Loc]]]:
        """Blocking: copy the live records of ``logs`` into a new log (fsynced, renamed
        into place); returns it and the moves to make in the index."""
        assert self._index is not None
        by_id = {log.id: log for log in logs}
        positions = self._index.positions_in(set(by_id))
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        moves: list[tuple[bytes, Loc, Loc]] = []
        try:
            pos = FILE_HEADER_SIZE
            os.pwrite(fd, encode_file_header(LOG_MAGIC, new_id), 0)
            for key, loc in positions:
                data = os.pread(by_id[loc.log].fd, loc.length, loc.offset)
                os.pwrite(fd, data, pos)
                moves.append((key, loc, Loc(new_id, pos, len(data))))
                pos += len(data)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        final = tmp.with_name(tmp.name[: -len(".tmp")])
        os.replace(tmp, final)
        self._logs.sync_dir(dir_index)
        self._counters.fsyncs += 2
        return final, moves

    @staticmethod
    def _move(
        index: LedgerIndex, moves: list[tuple[bytes, Loc, Loc]], dropped: list[int]
    ) -> tuple[int, dict[int, int]]:
        moved = index.move(moves, dropped=dropped)
        return moved, index.load_live()

    async def _compactor(self) -> None:
        minor_t, minor_every = self._minor
        major_t, major_every = self._major
        next_major = trio.current_time() + major_every
        while True:
            await trio.sleep(minor_every)
            threshold = minor_t
            if trio.current_time() >= next_major:
                threshold, next_major = major_t, trio.current_time() + major_every
            try:
                await self.compact(threshold)
            except (StorageError, OSError) as exc:
                logger.error("compaction failed (retried): %s", exc)

    # ------------------------------------------------------------------ queries

    def last_entry_id(self, segment_id: int) -> int:
        """Last entry id stored, -1 if none."""
        return self._get(segment_id).next_id - 1

    def read_lac(self, segment_id: int) -> int:
        """The highest last-add-confirmed the writer piggybacked (-1: none)."""
        return self._get(segment_id).lac

    def segment_info(self, segment_id: int) -> SegmentInfo:
        seg = self._get(segment_id)
        return SegmentInfo(
            segment_id=seg.id,
            last_entry_id=seg.next_id - 1,
            lac=seg.lac,
            fenced=seg.fenced,
            size_bytes=seg.size_bytes,
            entry_count=seg.next_id,
            corrupt_entries=len(seg.corrupt),
        )

    def segments(self) -> list[int]:
        """Ids of the stored segments, ascending."""
        self._check_running()
        return sorted(self._segs)

    def idle_time(self, segment_id: int) -> float:
        """Seconds (trio clock) since the segment was created, last added to or fenced
        (for a segment found at start: since its last checkpoint or journal write)."""
        return max(0.0, trio.current_time() - self._get(segment_id).touched)

    def statistics(self) -> StoreStatistics:
        c = self._counters
        index = self._index.disk_usage() if self._index is not None else 0
        return StoreStatistics(
            segments=len(self._segs),
            entries_written=c.entries_written,
            bytes_written=c.bytes_written,
            entries_read=c.entries_read,
            bytes_read=c.bytes_read,
            fsyncs=c.fsyncs,
            flush_seconds=c.flush_seconds,
            flush_rounds=c.flush_rounds,
            disk_usage_bytes=self._journal.disk_usage() + self._logs.disk_usage() + index,
            corrupt_entries_detected=c.corrupt,
            read_only=self._read_only is not None,
            read_only_reason=self._read_only or "",
            damaged_entries=sum(len(s.corrupt) for s in self._segs.values()),
            torn_tails=c.torn_tails,
            torn_entries=c.torn_entries,
            repaired_entries=c.repaired,
            inline_flush_rounds=c.inline_rounds,
        )


def _unlink_journals(files: list[JournalFile]) -> None:
    for jf in files:
        try:
            os.close(jf.fd)
        except OSError:
            pass
        jf.path.unlink(missing_ok=True)


def _unlink_all(paths: list[Path]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _round_io(
    writes: list[LogWrite], fds: list[int], dir_fd: int | None, drops: list[DropBehind]
) -> tuple[OSError | None, OSError | None]:
    """Blocking: a round's entry-log writes, then the journal's fdatasync (one thread
    hop for both) and its ``drops``; the errors of each."""
    return write_reserved(writes), fsync_many(fds, dir_fd, drops)
