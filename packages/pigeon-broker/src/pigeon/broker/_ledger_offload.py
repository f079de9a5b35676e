"""The ledger's tiered storage: closed segments copied to an offloader, bookie copies
released after a lag.

A segment is offloaded whole (read from the bookies in batches, written through the
:class:`pigeon.core.offload.Offloader`), and only then recorded in the ledger's
metadata (``offload``: the location, ``offload_time_ms``).  A failed upload records
nothing: the bookie copy stays and the next run tries again; a crash between the upload
and the metadata update leaves objects that the retry overwrites (same key).  Only
closed segments are offloaded, never the last one.  Once ``offload_deletion_lag_s`` has
passed, ``bookies_deleted`` is recorded first and the bookie copies deleted after (by
the topic), so no reader is ever sent to bookies that no longer hold the segment.

**No offloaded prefix.**  Segments are offloaded oldest first, but nothing relies on
the offloaded ones forming a prefix of the ledger: every reader of the metadata (reads,
retention, the deletion lag, the auditor, ``offload-status``) looks at one segment's
``offload`` at a time.  So a segment that cannot be read whole — an entry on no replica
intact (``CorruptEntry``) — does not hold back the ones after it: it is skipped and
kept in ``offload_damaged`` (listed by offload-status, one WARNING when first found),
its bookie copies stay (it has no location, so none are ever released), and it is
retried with backoff (``OFFLOAD_DAMAGE_RETRY_S`` doubling up to
``OFFLOAD_DAMAGE_RETRY_MAX_S``; at once by a manual offload) in case a repair fixed it.

**No orphan objects.**  An upload and the removal of its segment (retention, topic
deletion) may overlap; neither may leave an object nothing refers to, and no object a
segment still refers to may go.  Before an upload starts, ``offload_pending`` (the
driver and key) is saved in the segment's metadata.  Whoever removes a segment removes
it from the metadata first, then deletes its recorded location *and* its pending key.
After the upload, the uploader records the location (compare-and-set); when it cannot
(the ledger was closed, the segment trimmed, the save refused), it reads the stored
metadata afresh and deletes what it wrote only if the segment is no longer there
(segment ids are never reused, so a segment gone is gone for good).  Either the removal
comes after that read, and the remover deletes the pending key after the object was
written, or before it, and the uploader deletes it.  A segment still in the metadata
keeps its objects: the next offload overwrites them (same key).  Retention saves the
removal together with the intent to delete (``offload_deleting``: the locations and
pending keys of the removed segments) and forgets an object only once it is deleted
(``delete_removed_objects``), so a failed delete or a crash in between leaves work for
the next maintenance pass, not an orphan.  What a crash still leaves elsewhere (a
deleted topic's upload whose broker died) is for the sweeper
(``pigeon.broker._offload_sweeper``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pigeon.broker._ledger_reads import LedgerReads
from pigeon.broker._ledger_state import SegmentInfo, log
from pigeon.core.errors import CorruptEntry, NotOwner, OffloadError, PigeonError, ServiceUnavailable

__all__ = ["LedgerOffload", "OffloadDamage"]

#: entries read from the bookies per batch handed to the offloader
OFFLOAD_READ_ENTRIES = 1000
#: a segment found damaged is retried this long after, the wait doubling per attempt
OFFLOAD_DAMAGE_RETRY_S = 60.0
#: up to this long between retries of a damaged segment
OFFLOAD_DAMAGE_RETRY_MAX_S = 3600.0


@dataclass(slots=True)
class OffloadDamage:
    """A segment not offloaded because entry ``entry_id`` is on no replica intact."""

    segment_id: int
    entry_id: int
    error: str
    attempts: int
    #: wall clock (ms) from which it is retried
    retry_at_ms: int

    def status(self, now_ms: int) -> dict[str, Any]:
        """What offload-status shows of it."""
        return {
            "segment": self.segment_id,
            "entry": self.entry_id,
            "error": self.error,
            "attempts": self.attempts,
            "retry_in_s": round(max(0, self.retry_at_ms - now_ms) / 1000, 3),
        }


class LedgerOffload(LedgerReads):
    """Offloading a ledger's closed segments."""

    def offload_candidates(
        self, threshold_bytes: int, *, retry_damaged: bool = False
    ) -> list[SegmentInfo]:
        """The oldest closed segments to offload so that at most ``threshold_bytes``
        stay only on bookies (the segment being written counts, it is never offloaded).
        A damaged segment (``offload_damaged``) is left out until its retry is due (or
        with ``retry_damaged``); the ones after it are not."""
        now = self.clock.now_ms()
        resident = sum(s.size for s in self.segments if s.offload is None)
        out: list[SegmentInfo] = []
        for seg in self.segments[:-1]:
            if resident <= threshold_bytes or seg.state != "closed":
                break
            if seg.offload is not None or seg.entries <= 0:
                continue
            damage = self.offload_damaged.get(seg.id)
            if damage is not None and not retry_damaged and now < damage.retry_at_ms:
                continue  # stays on its bookies (and counts as such) until due
            out.append(seg)
            resident -= seg.size
        return out

    @property
    def offloading(self) -> bool:
        return self._offloading

    def offload_damage(self) -> list[dict[str, Any]]:
        """The segments not offloaded because they are damaged (see module doc), oldest
        first; forgets those no longer in the ledger (trimmed)."""
        for seg_id in [i for i in self.offload_damaged if self.index_of_segment(i) is None]:
            del self.offload_damaged[seg_id]
        now = self.clock.now_ms()
        return [self.offload_damaged[i].status(now) for i in sorted(self.offload_damaged)]

    async def offload(self, threshold_bytes: int, *, retry_damaged: bool = False) -> list[int]:
        """Offload the oldest closed segments (see ``offload_candidates``), one at a
        time; returns the ids offloaded.  A damaged segment is skipped (kept in
        ``offload_damaged``, the status ``ERROR`` naming it) and the run goes on; any
        other failure stops the run and is kept in ``offload_status`` (``ERROR``);
        what was offloaded before it stays recorded."""
        if self.offloader is None:
            raise ServiceUnavailable(
                f"topic {self.topic}: no offloader (set managed_ledger_offload_driver)"
            )
        if self._offloading:
            return []
        self._offloading = True
        self.offload_status = {"status": "RUNNING", "last_error": ""}
        done: list[int] = []
        try:
            for seg in self.offload_candidates(threshold_bytes, retry_damaged=retry_damaged):
                if self.closed:
                    break
                if self.index_of_segment(seg.id) is None:
                    continue  # trimmed meanwhile
                if await self._offload_segment(seg):
                    done.append(seg.id)
        except NotOwner:
            self.offload_status = {"status": "ERROR", "last_error": "ownership lost"}
            raise
        except (PigeonError, OSError) as exc:
            error = " ".join(str(exc).split())
            self.offload_status = {"status": "ERROR", "last_error": error}
            log.warning("offload failed topic=%s error=%s; retried later", self.topic, error)
        else:
            damaged = self.offload_damage()
            if damaged:
                first = damaged[0]
                more = f" (and {len(damaged) - 1} more damaged)" if len(damaged) > 1 else ""
                self.offload_status = {
                    "status": "ERROR",
                    "last_error": f"segment {first['segment']} not offloaded: {first['error']};"
                    f" it stays on its bookies and is retried in {first['retry_in_s']:g} s"
                    f"{more}",
                }
            else:
                self.offload_status = {"status": "SUCCESS", "last_error": ""}
        finally:
            self._offloading = False
        self.offload_status["offloaded"] = done
        return done

    async def _segment_batches(
        self, seg: SegmentInfo, damage: list[tuple[int, str]]
    ) -> AsyncIterator[list[tuple[int, bytes]]]:
        """The segment's entries in batches; an entry on no replica intact is noted in
        ``damage`` (the offloader may wrap the error) before the CorruptEntry goes on."""
        entry_id = 0
        while entry_id <= seg.last_entry_id:
            try:
                entries = await self.read((seg.id, entry_id), max_entries=OFFLOAD_READ_ENTRIES)
            except CorruptEntry as exc:
                damage.append((entry_id, " ".join(str(exc).split())))
                raise
            if not entries or entries[0].position != (seg.id, entry_id):
                raise OffloadError(f"segment {seg.id} of {self.topic} is gone (trimmed)")
            yield [(e.entry_id, bytes(e.data)) for e in entries]
            entry_id = entries[-1].entry_id + 1

    async def _offload_segment(self, seg: SegmentInfo) -> bool:
        """Upload ``seg`` and record where it went; False when it was not recorded (it
        is damaged, or it was removed or the ledger closed meanwhile)."""
        key = f"{self.topic.path}/{seg.id}"
        await self._mark_pending(seg, key)
        started = time.perf_counter()
        damage: list[tuple[int, str]] = []
        try:
            location = await self.offloader.offload(key, seg.id, self._segment_batches(seg, damage))
        except (PigeonError, OSError):
            if damage:
                self._note_damage(seg, *damage[0])
                return False
            if self.index_of_segment(seg.id) is None:  # trimmed meanwhile
                if seg.offload_pending is not None:  # whatever part of it was written
                    await self._drop_if_unreferenced(seg, seg.offload_pending)
                return False
            raise
        if not await self._record_offload(seg, location):
            return False
        if self.offload_damaged.pop(seg.id, None) is not None:
            log.info("damaged segment offloaded topic=%s segment=%s (repaired)", self.topic, seg.id)
        log.info(
            "segment offloaded topic=%s segment=%s entries=%s bytes=%s driver=%s seconds=%.3f",
            self.topic,
            seg.id,
            location.get("entries"),
            location.get("size"),
            location.get("driver"),
            time.perf_counter() - started,
        )
        return True

    async def _mark_pending(self, seg: SegmentInfo, key: str) -> None:
        """Save ``offload_pending`` before the upload (once: a retry reuses the key)."""
        pending = {"driver": str(getattr(self.offloader, "name", "")), "key": key}
        if seg.offload_pending == pending:
            return
        previous, seg.offload_pending = seg.offload_pending, pending
        try:
            await self._save()
        except BaseException:
            seg.offload_pending = previous
            raise

    async def _record_offload(self, seg: SegmentInfo, location: dict[str, Any]) -> bool:
        """Record ``location`` on ``seg``; when it cannot be (the ledger closed, the
        segment trimmed, the save refused), delete the objects if the segment is gone
        from the stored metadata, and return False (or raise what the save raised)."""
        index = self.index_of_segment(seg.id)
        if self.closed or index is None or self.segments[index] is not seg:
            await self._drop_if_unreferenced(seg, location)
            return False
        pending = seg.offload_pending
        seg.offload, seg.offload_time_ms, seg.offload_pending = location, self.clock.now_ms(), None
        try:
            await self._save()
        except BaseException as exc:
            seg.offload, seg.offload_time_ms, seg.offload_pending = None, 0, pending
            if isinstance(exc, PigeonError):
                await self._drop_if_unreferenced(seg, location)
            raise
        return True

    async def _drop_if_unreferenced(self, seg: SegmentInfo, location: dict[str, Any]) -> None:
        """Delete the objects just written for ``seg`` if the stored metadata no longer
        holds the segment (deleted topic, trimmed); else keep them (still its key)."""
        try:
            stat = await self.store.get(self.path)
            ids = (
                {s.get("id") for s in json.loads(stat.value).get("segments", [])} if stat else set()
            )
        except (PigeonError, ValueError) as exc:
            log.warning(
                "offloaded copy kept topic=%s segment=%s: cannot read the ledger (%s)",
                self.topic,
                seg.id,
                exc,
            )
            return
        if seg.id in ids:
            log.info(
                "offloaded copy not recorded topic=%s segment=%s (ledger closed or changed);"
                " the next offload overwrites it",
                self.topic,
                seg.id,
            )
            return
        try:
            await self.offloader.delete(location)
        except PigeonError as exc:
            log.warning(
                "offloaded copy of a removed segment left topic=%s location=%s error=%s",
                self.topic,
                location,
                exc,
            )
            return
        log.info(
            "offloaded copy deleted topic=%s segment=%s: the segment was removed during its upload",
            self.topic,
            seg.id,
        )

    def _note_damage(self, seg: SegmentInfo, entry_id: int, error: str) -> None:
        """Keep ``seg`` out of offloads until its retry is due (see module doc)."""
        now = self.clock.now_ms()
        previous = self.offload_damaged.get(seg.id)
        attempts = previous.attempts + 1 if previous is not None else 1
        delay = min(OFFLOAD_DAMAGE_RETRY_S * 2 ** (attempts - 1), OFFLOAD_DAMAGE_RETRY_MAX_S)
        self.offload_damaged[seg.id] = OffloadDamage(
            seg.id, entry_id, error, attempts, now + int(delay * 1000)
        )
        if previous is None:
            log.warning(
                "segment not offloaded topic=%s segment=%s entry=%s error=%s; it stays on its"
                " bookies and is retried in %gs (backoff), later segments are offloaded",
                self.topic,
                seg.id,
                entry_id,
                error,
                delay,
            )
        else:
            log.info(
                "segment still damaged topic=%s segment=%s entry=%s attempts=%s; retried in %gs",
                self.topic,
                seg.id,
                entry_id,
                attempts,
                delay,
            )

    async def delete_removed_objects(self, offloader: Any) -> int:
        """Delete the offloaded objects of removed segments (``offload_deleting``: saved
        with their removal, see ``trim``) and forget those deleted; returns how many.
        What fails stays listed and is retried by the next maintenance pass, by this
        owner or the next one."""
        if offloader is None:
            log.warning(
                "offloaded objects of removed segments kept topic=%s: no offloader objects=%s",
                self.topic,
                self.offload_deleting,
            )
            return 0
        deleted: list[dict[str, Any]] = []
        for location in list(self.offload_deleting):
            try:
                await offloader.delete(location)
            except PigeonError as exc:
                log.warning(
                    "offloaded delete failed topic=%s location=%s error=%s; retried later",
                    self.topic,
                    location,
                    exc,
                )
                continue
            deleted.append(location)
        if not deleted:
            return 0
        before = list(self.offload_deleting)
        self.offload_deleting = [loc for loc in before if loc not in deleted]
        try:
            await self._save()
        except BaseException:
            self.offload_deleting = before  # deleted again next time: idempotent
            raise
        return len(deleted)

    async def release_offloaded(self, lag_s: float, now_ms: int) -> list[SegmentInfo]:
        """Record ``bookies_deleted`` on offloaded segments older than ``lag_s``; returns
        them (the caller deletes their bookie copies, after this is saved)."""
        due = [
            s
            for s in self.segments[:-1]
            if s.offload is not None
            and not s.bookies_deleted
            and now_ms - s.offload_time_ms >= lag_s * 1000
        ]
        if not due:
            return []
        for seg in due:
            seg.bookies_deleted = True
        try:
            await self._save()
        except BaseException:
            for seg in due:
                seg.bookies_deleted = False
            raise
        log.info(
            "bookie copies released topic=%s segments=%s (offloaded)",
            self.topic,
            [s.id for s in due],
        )
        return due
