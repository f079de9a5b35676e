"""The read path of a segment store.

The entries' positions come from the in-memory dense position list (the recent entries
of each segment) or from the sparse index plus a forward scan; the file is read with
``os.pread`` in large windows, each payload is checked against its CRC32C and returned
as ``bytes``.  Reads up to ``inline_read_bytes`` run in the trio thread (page-cache
copies of a few hundred KiB); larger ones and index scans run in a worker thread, so a
catch-up read never stalls appends for long.
"""

from __future__ import annotations

import functools
import os
from bisect import bisect_right
from collections.abc import Callable

import trio

from pigeon.bookie._segment_scan import collect_entries
from pigeon.bookie._storage_state import SegmentState, StoreBase, logger, pread
from pigeon.core.errors import CorruptEntry, EntryNotFound, InvalidArgument

__all__ = ["READ_AHEAD_BYTES", "StoreReads"]


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


class StoreReads(StoreBase):
    """Range reads, verified, inline or in a worker thread."""

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
    ) -> tuple[SegmentState, int, int]:
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
        self, seg: SegmentState, first: int, last: int, max_bytes: int, max_count: int
    ) -> tuple[Callable[[], tuple[list[tuple[int, bytes]], int, bool]], int, int]:
        """``(job, span, cp_id)``: the blocking read to run (safe in a worker thread:
        it touches no shared state), an estimate of its bytes, and the checkpoint it
        starts from (-1 when it starts at ``first``, from the dense positions)."""
        read = functools.partial(pread, seg.fd)
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
        seg: SegmentState,
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

    def _corrupt(self, seg: SegmentState, entry_id: int) -> CorruptEntry:
        self._counters.corrupt += 1
        if entry_id not in seg.corrupt:  # logged once; later reads fail at once
            seg.corrupt.add(entry_id)  # (a repair clears it)
            logger.error(
                "damaged entry not returned segment=%d entry=%d: it failed its checksum",
                seg.id,
                entry_id,
            )
        return CorruptEntry(f"segment={seg.id} entry={entry_id} failed its checksum")
