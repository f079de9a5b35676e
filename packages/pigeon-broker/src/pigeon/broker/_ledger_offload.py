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
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from pigeon.broker._ledger_reads import LedgerReads
from pigeon.broker._ledger_state import SegmentInfo, log
from pigeon.core.errors import NotOwner, OffloadError, PigeonError, ServiceUnavailable

__all__ = ["LedgerOffload"]

#: entries read from the bookies per batch handed to the offloader
OFFLOAD_READ_ENTRIES = 1000


class LedgerOffload(LedgerReads):
    """Offloading a ledger's closed segments."""

    def offload_candidates(self, threshold_bytes: int) -> list[SegmentInfo]:
        """The oldest closed segments to offload so that at most ``threshold_bytes``
        stay only on bookies (the segment being written counts, it is never offloaded)."""
        resident = sum(s.size for s in self.segments if s.offload is None)
        out: list[SegmentInfo] = []
        for seg in self.segments[:-1]:
            if resident <= threshold_bytes or seg.state != "closed":
                break
            if seg.offload is None and seg.entries > 0:
                out.append(seg)
                resident -= seg.size
        return out

    @property
    def offloading(self) -> bool:
        return self._offloading

    async def offload(self, threshold_bytes: int) -> list[int]:
        """Offload the oldest closed segments (see ``offload_candidates``), one at a
        time; returns the ids offloaded.  A failure stops the run and is kept in
        ``offload_status`` (``ERROR``); what was offloaded before it stays recorded."""
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
            for seg in self.offload_candidates(threshold_bytes):
                if self.closed:
                    break
                await self._offload_segment(seg)
                done.append(seg.id)
        except NotOwner:
            self.offload_status = {"status": "ERROR", "last_error": "ownership lost"}
            raise
        except (PigeonError, OSError) as exc:
            error = " ".join(str(exc).split())
            self.offload_status = {"status": "ERROR", "last_error": error}
            log.warning("offload failed topic=%s error=%s; retried later", self.topic, error)
        else:
            self.offload_status = {"status": "SUCCESS", "last_error": ""}
        finally:
            self._offloading = False
        self.offload_status["offloaded"] = done
        return done

    async def _segment_batches(self, seg: SegmentInfo) -> AsyncIterator[list[tuple[int, bytes]]]:
        entry_id = 0
        while entry_id <= seg.last_entry_id:
            entries = await self.read((seg.id, entry_id), max_entries=OFFLOAD_READ_ENTRIES)
            if not entries or entries[0].position != (seg.id, entry_id):
                raise OffloadError(f"segment {seg.id} of {self.topic} is gone (trimmed)")
            yield [(e.entry_id, bytes(e.data)) for e in entries]
            entry_id = entries[-1].entry_id + 1

    async def _offload_segment(self, seg: SegmentInfo) -> None:
        key = f"{self.topic.path}/{seg.id}"
        started = time.perf_counter()
        location = await self.offloader.offload(key, seg.id, self._segment_batches(seg))
        if self.index_of_segment(seg.id) is None:  # trimmed meanwhile: nothing to keep
            await self.offloader.delete(location)
            return
        seg.offload = location
        seg.offload_time_ms = self.clock.now_ms()
        try:
            await self._save()
        except BaseException:
            seg.offload, seg.offload_time_ms = None, 0
            raise
        log.info(
            "segment offloaded topic=%s segment=%s entries=%s bytes=%s driver=%s seconds=%.3f",
            self.topic,
            seg.id,
            location.get("entries"),
            location.get("size"),
            location.get("driver"),
            time.perf_counter() - started,
        )

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
