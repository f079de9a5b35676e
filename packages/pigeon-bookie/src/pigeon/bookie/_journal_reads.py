"""The read path of a journal store.

Where the entries are: the segment's recent entries (written since the last
checkpoint) and those a checkpoint is indexing come from memory, older ones from the
LMDB index (a memory-mapped B+tree lookup); the newest copy wins (a repair supersedes a
damaged one).  The records are read with ``os.pread`` (adjacent records of one entry
log in one call), each checked against its header and CRC32C, and returned as
``bytes``; a damaged one is never returned.  Reads up to ``inline_read_bytes`` run in
the trio thread, larger ones in a worker thread that holds the entry logs it reads
open (compaction closes a log it deleted only once no reader uses it).
"""

from __future__ import annotations

import os

import trio

from pigeon.bookie._journal_format import RECORD_HEADER_SIZE, decode_entry
from pigeon.bookie._journal_index import Loc
from pigeon.bookie._journal_logs import EntryLog
from pigeon.bookie._journal_state import JournalBase, Seg, logger
from pigeon.bookie._segment import Buffer
from pigeon.core.errors import CorruptEntry, EntryNotFound, InvalidArgument

__all__ = ["JournalReads"]

#: adjacent records are read with one pread up to this many bytes
_COALESCE = 4 << 20

#: ``[(entry id, log, location, payload if its entry-log write is not done yet)]``
Plan = list[tuple[int, EntryLog, Loc, Buffer | None]]


def _read_plan(segment_id: int, plan: Plan) -> tuple[list[tuple[int, bytes]], int]:
    """Blocking (safe in a worker thread): the payloads of ``plan`` in order, up to
    the first damaged one, whose id is returned too (-1: none)."""
    out: list[tuple[int, bytes]] = []
    i, n = 0, len(plan)
    while i < n:
        eid, log, loc, mem = plan[i]
        if mem is not None:  # still in memory (the store's own bytes: no check)
            out.append((eid, bytes(mem)))
            i += 1
            continue
        j, end = i + 1, loc.offset + loc.length
        while (
            j < n
            and plan[j][1] is log
            and plan[j][2].offset == end
            and plan[j][3] is None
            and end - loc.offset < _COALESCE
        ):
            end += plan[j][2].length
            j += 1
        try:
            buf = os.pread(log.fd, end - loc.offset, loc.offset)
        except OSError as exc:
            logger.warning("entry log unreadable log=%d error=%s", log.id, exc)
            buf = b""
        # adjacent records are cut out of the one read without a copy: each payload is
        # copied once, into its own bytes (a 4 MiB read was copied twice, record then
        # payload: a sixth of a catch-up's server CPU)
        view = memoryview(buf) if j - i > 1 else buf
        for k in range(i, j):
            eid, _log, at, _mem = plan[k]
            off = at.offset - loc.offset
            record = view[off : off + at.length] if j - i > 1 else buf
            data = decode_entry(record, segment_id, eid)
            if data is None:
                return out, eid
            out.append((eid, data))
        i = j
    return out, -1


class JournalReads(JournalBase):
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

        Ids not stored are left out; stops after the last stored entry, before
        ``max_bytes`` of payload would be exceeded (one entry is always returned), at
        ``max_count`` ids, or before a damaged entry.  Raises SegmentNotFound,
        EntryNotFound (``first`` is not stored), CorruptEntry (``first`` is damaged)
        or InvalidArgument (``last < first``)."""
        seg, plan = self._plan(segment_id, first, last, max_bytes, max_count)
        return self._read_done(seg, first, _read_plan(seg.id, plan))

    async def read_entries_async(
        self,
        segment_id: int,
        first: int,
        last: int,
        *,
        max_bytes: int = 8 << 20,
        max_count: int = 10000,
    ) -> list[tuple[int, bytes]]:
        """:meth:`read_entries`, reads of more than ``inline_read_bytes`` in a worker
        thread."""
        await trio.lowlevel.checkpoint_if_cancelled()
        seg, plan = self._plan(segment_id, first, last, max_bytes, max_count)
        if sum(loc.length for _, _, loc, _ in plan) <= self._inline_read:
            result = _read_plan(seg.id, plan)
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            logs = {id(log): log for _, log, _, _ in plan}.values()
            for log in logs:
                log.refs += 1
            try:
                result = await trio.to_thread.run_sync(_read_plan, seg.id, plan)
            finally:
                for log in logs:
                    log.release()
        return self._read_done(seg, first, result)

    def _locate(self, seg: Seg, first: int, last: int, max_bytes: int) -> list[tuple[int, Loc]]:
        """Where entries ``first..last`` are (ids not stored left out), in id order,
        newest copies; possibly stopped early once past ``max_bytes``."""
        assert self._index is not None
        locs, stop = self._index.locate(seg.id, first, last, max_bytes)
        for mem in (seg.indexing, seg.recent):
            if not mem:
                continue
            if stop - first < len(mem):
                for eid in range(first, stop + 1):
                    loc = mem.get(eid)
                    if loc is not None:
                        locs[eid] = loc
            else:
                for eid, loc in mem.items():
                    if first <= eid <= stop:
                        locs[eid] = loc
        return sorted(locs.items())

    def _plan(
        self, segment_id: int, first: int, last: int, max_bytes: int, max_count: int
    ) -> tuple[Seg, Plan]:
        seg = self._get(segment_id)
        if first < 0 or last < first:
            raise InvalidArgument(f"bad entry range {first}..{last}")
        if first >= seg.next_id:
            raise EntryNotFound(
                f"segment={segment_id} entry={first} not stored (last={seg.next_id - 1})"
            )
        if first in seg.corrupt:
            raise self._corrupt(seg, first)
        last = min(last, seg.next_id - 1, first + max(1, max_count) - 1)
        found = self._locate(seg, first, last, max_bytes)
        if not found or found[0][0] != first:
            raise EntryNotFound(f"segment={segment_id} entry={first} not stored")
        plan: Plan = []
        total = 0
        logs = self._logs.logs
        unwritten = self._unwritten
        for eid, loc in found:
            if eid in seg.corrupt:
                break  # never read past a known damaged entry
            n = loc.length - RECORD_HEADER_SIZE
            if plan and total + n > max_bytes:
                break
            log = logs.get(loc.log)
            if log is None:  # the index names a log that is gone: the entry is lost
                if not plan:
                    raise self._corrupt(seg, eid)
                break
            total += n
            plan.append(
                (eid, log, loc, unwritten.get((loc.log, loc.offset)) if unwritten else None)
            )
        return seg, plan

    def _read_done(
        self, seg: Seg, first: int, result: tuple[list[tuple[int, bytes]], int]
    ) -> list[tuple[int, bytes]]:
        entries, bad = result
        if bad >= 0 and not seg.deleted:
            err = self._corrupt(seg, bad)
            if bad == first:
                raise err
        elif bad == first:
            raise EntryNotFound(f"segment={seg.id} entry={first} not stored")
        self._counters.entries_read += len(entries)
        self._counters.bytes_read += sum(len(p) for _, p in entries)
        return entries

    def _corrupt(self, seg: Seg, entry_id: int) -> CorruptEntry:
        self._counters.corrupt += 1
        if entry_id not in seg.corrupt:  # logged once; later reads fail at once
            seg.corrupt.add(entry_id)
            logger.error(
                "damaged entry not returned segment=%d entry=%d: it failed its checksum",
                seg.id,
                entry_id,
            )
        return CorruptEntry(f"segment={seg.id} entry={entry_id} failed its checksum")
