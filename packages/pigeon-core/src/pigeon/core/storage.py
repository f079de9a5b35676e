"""The ledger storage seam: what a bookie asks of the engine that keeps its segments.

A bookie stores entries of segments (BookKeeper's ledgers) on its own disks through a
:class:`LedgerStorage`, chosen by name among those registered with the
``pigeon_ledger_storages`` hook (``pigeon bookie --storage NAME``).  Built in:
``segment-files`` (one append-only file per segment, group-committed) and ``journal``
(BookKeeper's shape: one shared journal, interleaved entry logs, an index).  Every
backend passes :class:`pigeon.core.testing.LedgerStorageContract`.

The contract, which the bookie's replication protocol relies on (DESIGN §13):

* **Appends** of a segment come with growing entry ids, which may skip (a bookie of a
  striped ensemble stores only some entries; a replacement bookie starts mid-segment).
  An entry is acknowledged only once durable per the ``fsync`` policy (``always``: an
  fsync covers it); the returned :class:`AppendWaiter` tells when.
* **Fencing** is durable when :meth:`LedgerStorage.fence` returns; a fenced segment
  refuses appends (SegmentFenced) except recovery adds, which are idempotent for
  identical bytes and repair an entry stored damaged.
* **LAC**: the highest last-add-confirmed the writer piggybacked is kept per segment.
* **Reads** return ``(entry_id, payload)`` verified against a checksum; a damaged entry is
  never returned (CorruptEntry); an id never stored is EntryNotFound (and left out of
  range reads).
* **Recovery** after kill -9: every acknowledged entry is there; a torn tail (written,
  never acknowledged) is dropped; fenced flags and LACs survive.
* **Deletion**: a deleted segment is gone (and a retried delete succeeds); ``idle_time``
  lets the bookie's collector expire segments nobody wrote to for long.

All methods are called from trio tasks of one trio run, while :meth:`LedgerStorage.run`
runs (else ServiceUnavailable).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import trio

__all__ = ["AppendWaiter", "Buffer", "LedgerStorage", "SegmentInfo", "StoreStatistics"]

#: what an append takes: bytes, bytearray or a memoryview of a received frame
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """What a bookie knows of one of its segments."""

    segment_id: int
    #: highest entry id stored (-1: none).  Ids below it may be absent: a bookie of a
    #: striped ensemble stores only some entries, a replacement bookie starts mid-segment
    last_entry_id: int
    #: highest last-add-confirmed the writer piggybacked on an add (-1: none)
    lac: int
    #: fenced segments refuse adds (except recovery adds)
    fenced: bool
    #: bytes the segment's entries take on this bookie (records, headers included)
    size_bytes: int
    #: ``last_entry_id + 1``: the entry ids the segment spans (the entries stored when
    #: ids are contiguous from 0; an upper bound when they skip)
    entry_count: int
    #: entries known to be damaged on this bookie; reading them raises CorruptEntry
    corrupt_entries: int = 0


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """Counters of a ledger storage since it started (the bookie's /metrics)."""

    segments: int
    entries_written: int
    #: record bytes appended (headers included)
    bytes_written: int
    entries_read: int
    #: payload bytes returned by reads
    bytes_read: int
    #: fsync/fdatasync calls
    fsyncs: int
    flush_rounds: int
    #: bytes of all the store's files
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
    #: segments (or journal files) whose torn tail was dropped when the store started
    torn_tails: int = 0
    #: entries dropped with torn tails at start
    torn_entries: int = 0
    #: damaged entries rewritten from a good copy (recovery adds)
    repaired_entries: int = 0
    #: flush rounds whose blocking calls ran on the event loop, not on a thread (small
    #: rounds on a fast disk: see ``journal_inline_sync_max_bytes``)
    inline_flush_rounds: int = 0


@runtime_checkable
class AppendWaiter(Protocol):
    """Returned by :meth:`LedgerStorage.append`: when is the entry durable?"""

    @property
    def done(self) -> bool:
        """True once durable per the policy (or failed: see :attr:`error`)."""
        ...

    @property
    def error(self) -> Exception | None:
        """Why the entry is not durable, once :attr:`done`; None if it is."""
        ...

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` from a trio task of the store once :attr:`done` (at once if it
        is already): one callback per add, no task per add."""
        ...

    async def wait(self) -> None:
        """Return once durable; raise :attr:`error` if that failed."""
        ...


@runtime_checkable
class LedgerStorage(Protocol):
    """A bookie's segments on its disks (see the module documentation)."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open and recover everything stored, call ``task_status.started()``, serve until
        cancelled; on exit (shielded) make everything written durable and close."""
        ...

    def append(
        self, segment_id: int, entry_id: int, data: Buffer, *, lac: int = -1, recovery: bool = False
    ) -> AppendWaiter:
        """Write entry ``entry_id`` now (above the segment's last entry id; the first add
        creates the segment).  ``recovery=True``: BookKeeper's recovery add (accepted on a
        fenced segment; idempotent for identical bytes; repairs a damaged copy).  Raises
        at once InvalidEntryId, SegmentFenced, BookieReadOnly, InvalidArgument.

        The store may keep ``data`` by reference (no copy) until the waiter is done:
        the caller must not change the buffer before (a received frame never is)."""
        ...

    async def add_entry(
        self, segment_id: int, entry_id: int, data: Buffer, *, lac: int = -1, recovery: bool = False
    ) -> None:
        """:meth:`append`, then wait until durable."""
        ...

    async def add_entries(
        self,
        segment_id: int,
        first_entry_id: int,
        entries: Sequence[Buffer],
        *,
        lac: int = -1,
        recovery: bool = False,
    ) -> None:
        """Append ``entries`` as consecutive ids from ``first_entry_id``, one wait."""
        ...

    def read_entries(
        self, segment_id: int, first: int, last: int, *, max_bytes: int = ..., max_count: int = ...
    ) -> list[tuple[int, bytes]]:
        """Entries ``first..last`` as ``(entry_id, payload)``, verified; ids not stored are
        left out; stops before a damaged entry, after ``max_bytes`` (one entry at least)
        or ``max_count`` ids.  Raises SegmentNotFound, EntryNotFound, CorruptEntry (for
        ``first``), InvalidArgument."""
        ...

    async def read_entries_async(
        self, segment_id: int, first: int, last: int, *, max_bytes: int = ..., max_count: int = ...
    ) -> list[tuple[int, bytes]]:
        """:meth:`read_entries`, large reads off the trio thread."""
        ...

    async def fence(self, segment_id: int) -> int:
        """Fence the segment (durably) and return its last entry id; an unknown segment
        is created fenced and empty (-1)."""
        ...

    async def delete_segment(self, segment_id: int) -> None:
        """Remove the segment durably; unknown ids are ignored."""
        ...

    async def sync(self) -> None:
        """Make everything written so far durable."""
        ...

    def last_entry_id(self, segment_id: int) -> int: ...

    def read_lac(self, segment_id: int) -> int: ...

    def segment_info(self, segment_id: int) -> SegmentInfo: ...

    def segments(self) -> list[int]:
        """Ids of the stored segments, ascending."""
        ...

    def idle_time(self, segment_id: int) -> float:
        """Seconds (trio clock) since the segment was created, added to or fenced."""
        ...

    def statistics(self) -> StoreStatistics: ...

    @property
    def read_only(self) -> str | None:
        """Why the store refuses adds (None: writable)."""
        ...

    def set_read_only(self, reason: str | None) -> bool:
        """Refuse (reason) or accept (None) adds, for the bookie's free-space check.

        Going writable again does not undo a read-only state an I/O error caused
        (that lasts until a restart); returns whether the store is writable afterwards."""
        ...


#: ``factory(config) -> LedgerStorage``: what ``pigeon_ledger_storages`` registers
LedgerStorageFactory = Callable[[Any], LedgerStorage]
