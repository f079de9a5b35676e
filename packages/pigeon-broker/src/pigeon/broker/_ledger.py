"""Managed ledger: a topic partition as an ordered list of segments on bookies.

Metadata (JSON in the metadata store):

* ``/pigeon/ledgers/<domain>/<tenant>/<namespace>/<topic>`` — the ledger: its segments in
  order, each ``{"id", "first_offset", "last_entry_id", "entries", "size", "state",
  "ensemble", "ctime", "last_publish_time"}``; ``state`` is ``open`` while a writer may
  append and ``closed`` (with ``last_entry_id`` fixed) afterwards.  Updated with
  compare-and-set, so two brokers can never both think they own the tail.
* ``/pigeon/segment-ids/s-`` — sequential nodes that hand out unique segment ids.

The ledger never re-opens a segment after a restart: it *recovers* the last one (fence +
find the last entry), closes it, and appends to a fresh one (BookKeeper's rule).

``ManagedLedger`` is put together from three modules: ``_ledger_state`` (the segments,
their metadata document, positions), ``_ledger_writes`` (appends, rollover, fencing) and
``_ledger_reads`` (reads, damaged runs, seeks, offloaded segments), ``_ledger_offload``
(tiered storage), ``_ledger_compaction`` (the compacted ledger); this one opens,
trims and closes it.
"""

from __future__ import annotations

import contextlib
import json
from collections import deque
from typing import Any

import trio

from pigeon.broker._ledger_compaction import LedgerCompaction
from pigeon.broker._ledger_state import (
    DamagedRun,
    Entry,
    LedgerConfig,
    Position,
    SegmentInfo,
    log,
)
from pigeon.core.errors import CorruptEntry, PigeonError, ServiceUnavailable
from pigeon.core.paths import cursors_path, segment_path

__all__ = ["DamagedRun", "Entry", "LedgerConfig", "ManagedLedger", "Position", "SegmentInfo"]


class ManagedLedger(LedgerCompaction):
    """One persistent topic partition: opened (recovering what a previous owner left
    open), written (``LedgerWrites``), read (``LedgerReads``), trimmed and closed."""

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
            self.segments = [SegmentInfo.from_doc(s) for s in doc.get("segments", [])]
            recorded_offset = int(doc.get("next_offset", 0))
            self.offload_deleting = [dict(d) for d in doc.get("offload_deleting", [])]
            self._keep_unknown(doc)
            self._load_compaction(doc)
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
        self._entries_changed()

    def internal_stats(self) -> dict[str, Any]:
        """The ledger's offsets, segments and cache (the admin API's internal stats)."""
        return {
            "next_offset": self.next_offset,
            "first_offset": self.first_offset,
            "last_position": list(self.last_position),
            "segments": [
                {
                    "id": s.id,
                    "first_offset": s.first_offset,
                    "entries": s.entries,
                    "last_entry_id": s.last_entry_id,
                    "size": s.size,
                    "state": s.state,
                    "ensemble": list(s.ensemble),
                    "ctime": s.ctime,
                    "last_publish_time": s.last_publish_time,
                    "offload": s.offload,
                    "offload_pending": s.offload_pending,
                    "bookies_deleted": s.bookies_deleted,
                }
                for s in self.segments
            ],
            "compacted_ledger": self.compacted.to_doc() if self.compacted is not None else None,
            "compaction_horizon": self.compacted.horizon if self.compacted is not None else None,
            "offload_deleting": [dict(loc) for loc in self.offload_deleting],
            "cache": {
                "hits": self.cache.hits,
                "misses": self.cache.misses,
                "bytes": self.cache.bytes,
            },
        }

    # ------------------------------------------------------------------ retention

    def _segment_end(self, index: int) -> int:
        """One past the last offset of segment ``index``."""
        if index + 1 < len(self.segments):
            return self.segments[index + 1].first_offset
        return self.next_offset

    def bytes_since_compaction(self) -> int:
        """Stored bytes after the compaction horizon (all before the first compaction)."""
        c = self.compacted
        return self.bytes_after(c.horizon if c is not None else self.first_offset)

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
        # the intent to delete their offloaded objects is saved with their removal, so
        # that a crash before the objects are deleted leaves no orphan: whoever owns the
        # ledger next deletes them (``delete_removed_objects``)
        deleting = [loc for s in trimmed for loc in s.offloaded_objects()]
        del self.segments[: len(trimmed)]
        self.offload_deleting.extend(deleting)
        self._reindex()
        try:
            await self._save()
        except BaseException:
            # not known to be saved: their objects must not be deleted on that basis
            del self.offload_deleting[len(self.offload_deleting) - len(deleting) :]
            raise
        self.last_trimmed_ensembles = {
            s.id: [] if s.bookies_deleted else list(s.ensemble) for s in trimmed
        }
        self.last_trimmed = trimmed
        log.info("trimmed topic=%s segments=%s", self.topic, [s.id for s in trimmed])
        return [s.id for s in trimmed]
