"""The write path of a segment store.

Per add, in the trio thread: one ``os.pwritev`` of the record headers and the payloads
as separate buffers (the payloads are the caller's memoryviews of the received frames,
written as they are: the kernel copies them into the page cache; only a payload under
64 KiB is copied once more, for its checksum) at the known end of the file, then an
append to the in-memory position list (a skipped id gets a zero-length span there; a
jump over more than the dense window restarts it).  Durability is the group commit's
(:mod:`pigeon.bookie._storage_commit`).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence

import trio

from pigeon.bookie._index import (
    INDEX_HEADER_SIZE,
    INDEX_RECORD_SIZE,
    encode_checkpoints,
    encode_index_header,
)
from pigeon.bookie._segment import (
    MAX_PAYLOAD,
    RECORD_HEADER_SIZE,
    Buffer,
    encode_file_header,
    encode_record_header,
)
from pigeon.bookie._storage_commit import AppendWaiter, StoreCommit
from pigeon.bookie._storage_reads import StoreReads
from pigeon.bookie._storage_recovery import StoreRecovery
from pigeon.bookie._storage_state import (
    MAX_ENTRY_ID,
    SegmentState,
    as_buffer,
    check_segment_id,
    file_name,
    logger,
    pwritev_all,
    stored_damaged,
)
from pigeon.core.errors import (
    BookieReadOnly,
    InvalidArgument,
    InvalidEntryId,
    SegmentFenced,
    StorageError,
)

__all__ = ["StoreWrites"]


class StoreWrites(StoreCommit, StoreRecovery, StoreReads):
    """Appends (single and batched), recovery adds, segment creation."""

    def append(
        self,
        segment_id: int,
        entry_id: int,
        data: Buffer,
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
        payload = as_buffer(data)
        if recovery:
            seg = self._segments.get(segment_id)
            if seg is not None and 0 <= entry_id < seg.next_id:
                if stored_damaged(
                    self.read_entries, segment_id, entry_id, seg.next_id - 1, payload
                ):
                    self._repair(seg, entry_id, payload, lac)
                return self._durability(seg)
        seg = self._segment_for_append(segment_id, entry_id, lac, recovery)
        self._append(seg, entry_id, [payload], lac)
        return self._durability(seg)

    async def add_entry(
        self, segment_id: int, entry_id: int, data: Buffer, *, lac: int = -1, recovery: bool = False
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
        entries: Sequence[Buffer],
        *,
        lac: int = -1,
        recovery: bool = False,
    ) -> None:
        """Append ``entries`` as ids ``first_entry_id, first_entry_id + 1, ...`` with
        one write and one durability wait; like :meth:`add_entry` otherwise
        (``first_entry_id`` may skip ids; ``recovery`` only lifts the fence here)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_running()
        payloads = [as_buffer(d) for d in entries]
        if not payloads:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        seg = self._segment_for_append(segment_id, first_entry_id, lac, recovery)
        self._append(seg, first_entry_id, payloads, lac)
        await self._durability(seg).wait()

    def _segment_for_append(
        self, segment_id: int, entry_id: int, lac: int, recovery: bool
    ) -> SegmentState:
        check_segment_id(segment_id)
        if not 0 <= entry_id <= MAX_ENTRY_ID:
            raise InvalidEntryId(f"entry id out of range: {entry_id}")
        if not -1 <= lac <= MAX_ENTRY_ID:
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

    def _create_segment(self, segment_id: int) -> SegmentState:
        """Create the files of a new segment (blocking, but two small writes)."""
        log_path = self._dir / file_name(segment_id, ".log")
        try:
            fd = os.open(log_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:  # its delete has not finished yet
            raise StorageError(f"segment={segment_id} is being deleted")
        except OSError as exc:
            raise self._io_failed(f"create segment={segment_id}", exc)
        try:
            os.pwrite(fd, encode_file_header(segment_id), 0)
            idx_fd = os.open(
                self._dir / file_name(segment_id, ".idx"),
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
        seg = SegmentState(segment_id, fd, idx_fd)
        seg.touched = trio.current_time()
        self._segments[segment_id] = seg
        self._dir_dirty = True
        return seg

    def _append(self, seg: SegmentState, entry_id: int, payloads: list[Buffer], lac: int) -> None:
        """Write the records at the end of the data file (blocking: page-cache writes)."""
        bufs: list[Buffer] = []
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
            pwritev_all(seg.fd, bufs, start, pos - start)
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

    def _write_checkpoints(self, seg: SegmentState, checkpoints: list[tuple[int, int]]) -> None:
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
