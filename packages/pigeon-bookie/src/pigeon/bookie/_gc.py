"""Garbage collection of a bookie's segments: orphans and expired segments.

Two rules, applied by :class:`SegmentCollector` every ``interval_s``:

* **Orphans.**  A broker creates ``/pigeon/segments/<id as 16 hex digits>`` before it
  writes a segment and deletes it when retention trims the segment; a segment stored
  here whose node is gone is deleted from disk.  Only when the collector has a
  metadata store, only for segments idle (no add, no fence, not created) for
  ``grace_s`` or more -- so that a segment whose first adds raced its node's creation
  is never taken -- and never when ``/pigeon/segments`` itself is missing (a bookie
  pointed at the wrong metadata store must not wipe its disk).  A metadata error
  skips the round: a node that could not be read is never taken as missing.
* **Expiry** (``expiry_s > 0``; PigeonMQ's "segment validity period").  A bookie
  cannot tell a closed segment from an open one that is quiet (closing is a metadata
  operation; a fence only says that a writer was replaced), so *closed* here means
  **idle**: no add (normal or recovery), no fence and no creation for ``expiry_s``
  seconds, fenced or not.  Such a segment is deleted, with or without metadata.  After
  a restart, idleness counts from the mtime of the segment's files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio

from pigeon.core.errors import PigeonError, SegmentNotFound
from pigeon.core.paths import SEGMENTS_PATH, segment_path
from pigeon.core.storage import LedgerStorage

__all__ = ["CollectorStatistics", "SegmentCollector"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CollectorStatistics:
    #: collection rounds completed (including skipped ones)
    rounds: int
    #: segments deleted because their metadata node was gone
    orphans_deleted: int
    #: segments deleted because they were idle longer than the expiry
    expired_deleted: int
    #: bytes of segment files removed
    bytes_freed: int
    #: rounds whose orphan check was skipped (metadata error, no segments node)
    rounds_skipped: int


class SegmentCollector:
    """Deletes the orphaned and the expired segments of a ledger storage.

    Start :meth:`run` in a nursery (or call :meth:`collect` yourself).  ``metadata``
    may be None: then only expiry applies.
    """

    def __init__(
        self,
        store: LedgerStorage,
        metadata: Any = None,
        *,
        interval_s: float = 60.0,
        grace_s: float = 300.0,
        expiry_s: float = 0.0,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        if grace_s < 0 or expiry_s < 0:
            raise ValueError("grace_s and expiry_s must be >= 0")
        self.store = store
        self.metadata = metadata
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.expiry_s = expiry_s
        self._rounds = self._orphans = self._expired = self._freed = self._skipped = 0
        self._begun = self._ended = 0  # rounds started / finished (failed ones too)
        self._round_ended = trio.Event()

    def statistics(self) -> CollectorStatistics:
        return CollectorStatistics(
            rounds=self._rounds,
            orphans_deleted=self._orphans,
            expired_deleted=self._expired,
            bytes_freed=self._freed,
            rounds_skipped=self._skipped,
        )

    async def wait_round(self) -> None:
        """Return once a round that *begins* after this call has ended.

        What that round saw is at least as recent as the caller's view: under a mock
        clock, time may jump while a deletion waits for its worker thread, so "sleep
        past the threshold" alone does not mean a round has looked since.
        """
        target = self._begun + 1
        while self._ended < target:
            await self._round_ended.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Collect every ``interval_s`` (the first round one interval after start)."""
        task_status.started()
        while True:
            await trio.sleep(self.interval_s)
            try:
                await self.collect()
            except PigeonError as exc:  # e.g. the store is shutting down
                log.warning("segment collection failed error=%s", exc)

    def _idle(self, segment_id: int) -> float | None:
        try:
            return float(self.store.idle_time(segment_id))
        except SegmentNotFound:
            return None  # deleted meanwhile

    async def collect(self) -> list[tuple[int, str]]:
        """One round; returns the ``(segment id, "expired" | "orphan")`` deleted."""
        self._begun += 1
        try:
            return await self._collect()
        finally:
            self._ended += 1
            self._round_ended.set()
            self._round_ended = trio.Event()

    async def _collect(self) -> list[tuple[int, str]]:
        deleted: list[tuple[int, str]] = []
        orphan_candidates: list[int] = []
        for segment_id in self.store.segments():
            idle = self._idle(segment_id)
            if idle is None:
                continue
            if self.expiry_s and idle >= self.expiry_s:
                why = f"idle for {idle:.0f}s (expiry {self.expiry_s}s)"
                if await self._delete(segment_id, why):
                    self._expired += 1
                    deleted.append((segment_id, "expired"))
            elif self.metadata is not None and idle >= self.grace_s:
                orphan_candidates.append(segment_id)
        if orphan_candidates:
            for segment_id in await self._orphans_among(orphan_candidates):
                idle = self._idle(segment_id)  # an add may have come in meanwhile
                if idle is None or idle < self.grace_s:
                    continue
                if await self._delete(segment_id, "its metadata node is gone"):
                    self._orphans += 1
                    deleted.append((segment_id, "orphan"))
        self._rounds += 1
        return deleted

    async def _orphans_among(self, candidates: list[int]) -> list[int]:
        try:
            if await self.metadata.get(SEGMENTS_PATH) is None:
                log.warning(
                    "no %s node in the metadata store: not collecting orphaned segments"
                    " (is this bookie pointed at the right metadata store?)",
                    SEGMENTS_PATH,
                )
                self._skipped += 1
                return []
            orphans = []
            for segment_id in candidates:
                if await self.metadata.get(segment_path(segment_id)) is None:
                    orphans.append(segment_id)
            return orphans
        except PigeonError as exc:
            log.warning("metadata unavailable, orphan collection skipped error=%s", exc)
            self._skipped += 1
            return []

    async def _delete(self, segment_id: int, why: str) -> bool:
        before = self.store.statistics().disk_usage_bytes
        try:
            await self.store.delete_segment(segment_id)
        except PigeonError as exc:
            log.warning("cannot delete segment=%d error=%s", segment_id, exc)
            return False
        freed = max(0, before - self.store.statistics().disk_usage_bytes)
        self._freed += freed
        log.info("segment collected segment=%d bytes=%d reason=%s", segment_id, freed, why)
        return True
