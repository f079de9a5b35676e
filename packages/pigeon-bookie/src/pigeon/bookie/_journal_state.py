"""The in-memory state of a :class:`~pigeon.bookie._journal.JournalStore`: its
configuration, its segments, the group-commit rounds and the durability waiter of an
add, the read-only state.  The store's concerns are layered on :class:`JournalBase` in
:mod:`~pigeon.bookie._journal_reads` and :mod:`~pigeon.bookie._journal`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import trio

from pigeon.bookie._journal_file import Journal, JournalFile
from pigeon.bookie._journal_index import LedgerIndex, Loc
from pigeon.bookie._journal_logs import EntryLogs, LogWrite
from pigeon.bookie._segment import Buffer
from pigeon.bookie._storage_state import (
    DEFAULT_PAGE_CACHE_WINDOW,
    Counters,
    FlushThread,
    FsyncPolicy,
    InlineSyncs,
    ReadOnlyState,
    Round,
)
from pigeon.core.errors import (
    InvalidArgument,
    SegmentNotFound,
    ServiceUnavailable,
)

__all__ = ["JournalBase", "JournalRound", "Seg", "logger"]

logger = logging.getLogger("pigeon.bookie._journal")


class Seg:
    """One segment; mutated only from the trio thread."""

    __slots__ = (
        "corrupt",
        "deleted",
        "fenced",
        "id",
        "indexing",
        "lac",
        "next_id",
        "recent",
        "size_bytes",
        "touched",
    )

    def __init__(
        self,
        segment_id: int,
        *,
        next_id: int = 0,
        lac: int = -1,
        fenced: bool = False,
        size_bytes: int = 0,
        touched: float = 0.0,
    ) -> None:
        self.id = segment_id
        self.next_id = next_id
        self.lac = lac
        self.fenced = fenced
        #: record bytes of the segment's entries (headers included)
        self.size_bytes = size_bytes
        #: trio clock of the last add, fence or creation (wall clock while starting)
        self.touched = touched
        #: entries written since the last checkpoint: not in the index yet
        self.recent: dict[int, Loc] = {}
        #: entries a checkpoint in progress is putting in the index (read from here
        #: until it commits)
        self.indexing: dict[int, Loc] | None = None
        #: entries found damaged by reads (a repair clears them)
        self.corrupt: set[int] = set()
        self.deleted = False


class JournalRound(Round):
    """One group commit of the journal: the journal files written since the previous
    round, and the entry-log writes reserved meanwhile (done by the round, beside the
    journal's fdatasync; its waiters are
    :class:`~pigeon.bookie._storage_commit.AppendWaiter`)."""

    __slots__ = ("files", "journal_bytes", "log_bytes", "log_writes")

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[int, JournalFile] = {}
        self.log_writes: list[LogWrite] = []
        #: bytes of ``log_writes``
        self.log_bytes = 0
        #: bytes written to the journal for this round (what its fdatasync flushes)
        self.journal_bytes = 0


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise InvalidArgument(f"{name} must be > 0")


class JournalBase(ReadOnlyState):
    """Configuration and state of a journal store (see
    :class:`~pigeon.bookie._journal.JournalStore`)."""

    def __init__(
        self,
        journal_directory: str | os.PathLike[str],
        ledger_directories: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        fsync: FsyncPolicy = "always",
        fsync_interval_ms: float = 5.0,
        journal_max_group_wait_ms: float = 0.0,
        journal_inline_sync_max_bytes: int = 64 * 1024,
        journal_inline_sync_max_ms: float = 2.0,
        journal_max_size_mb: float = 512,
        journal_pre_alloc_size_mb: float = 16,
        entry_log_size_limit: int = 1 << 30,
        flush_interval_ms: float = 10_000.0,
        flush_entries: int = 200_000,
        flush_entrylog_bytes: int = 8 << 20,
        journal_remove_pages_from_cache: bool = True,
        page_cache_window_bytes: int = DEFAULT_PAGE_CACHE_WINDOW,
        minor_compaction_threshold: float = 0.2,
        minor_compaction_interval_s: float = 3600.0,
        major_compaction_threshold: float = 0.8,
        major_compaction_interval_s: float = 86400.0,
        inline_read_bytes: int = 256 * 1024,
        index_map_size: int = 1 << 38,
        format_root: str | os.PathLike[str] | None = None,
    ) -> None:
        if fsync not in ("always", "interval", "never"):
            raise InvalidArgument(f"fsync must be 'always', 'interval' or 'never', not {fsync!r}")
        _positive("fsync_interval_ms", fsync_interval_ms)
        _positive("journal_max_size_mb", journal_max_size_mb)
        _positive("flush_interval_ms", flush_interval_ms)
        _positive("minor_compaction_interval_s", minor_compaction_interval_s)
        _positive("major_compaction_interval_s", major_compaction_interval_s)
        if journal_max_group_wait_ms < 0:
            raise InvalidArgument("journal_max_group_wait_ms must be >= 0")
        if journal_inline_sync_max_bytes < 0:
            raise InvalidArgument("journal_inline_sync_max_bytes must be >= 0")
        _positive("journal_inline_sync_max_ms", journal_inline_sync_max_ms)
        if journal_pre_alloc_size_mb < 0:
            raise InvalidArgument("journal_pre_alloc_size_mb must be >= 0")
        if entry_log_size_limit < 4096:
            raise InvalidArgument("entry_log_size_limit must be >= 4096")
        if page_cache_window_bytes < -1:
            raise InvalidArgument("page_cache_window_bytes must be >= 0, or -1 (off)")
        if flush_entries < 1:
            raise InvalidArgument("flush_entries must be >= 1")
        if flush_entrylog_bytes < 0:
            raise InvalidArgument("flush_entrylog_bytes must be >= 0")
        for name, t in (
            ("minor_compaction_threshold", minor_compaction_threshold),
            ("major_compaction_threshold", major_compaction_threshold),
        ):
            if not 0 <= t <= 1:
                raise InvalidArgument(f"{name} must be in [0, 1]")
        if isinstance(ledger_directories, str | os.PathLike):
            ledger_directories = [ledger_directories]
        if not ledger_directories:
            raise InvalidArgument("ledger_directories must name at least one directory")
        self._journal_dir = Path(journal_directory)
        #: the bookie's data_dir: its FORMAT file names the backend that owns it
        self._format_root = Path(format_root) if format_root is not None else None
        self._ledger_dirs = [Path(d) for d in ledger_directories]
        self._policy: FsyncPolicy = fsync
        self._interval = fsync_interval_ms / 1000.0
        self._group_wait = journal_max_group_wait_ms / 1000.0
        self._flush_interval = flush_interval_ms / 1000.0
        self._flush_entries = flush_entries
        self._minor = (minor_compaction_threshold, minor_compaction_interval_s)
        self._major = (major_compaction_threshold, major_compaction_interval_s)
        self._inline_read = inline_read_bytes
        self._index_map_size = index_map_size
        self._journal = Journal(
            self._journal_dir,
            int(journal_max_size_mb * (1 << 20)),
            int(journal_pre_alloc_size_mb * (1 << 20)),
        )
        self._logs = EntryLogs(
            self._ledger_dirs, entry_log_size_limit, flush_entrylog_bytes, page_cache_window_bytes
        )
        self._remove_journal_pages = journal_remove_pages_from_cache
        #: an entry log has ``flush_entrylog_bytes`` to write behind
        self._write_behind_wanted = trio.Event()
        #: set while no write-behind is due or in flight (:meth:`wait_written_behind`)
        self._written_behind = trio.Event()
        self._written_behind.set()
        #: write-behinds done (ranges handed to the kernel)
        self.write_behinds = 0
        self._index: LedgerIndex | None = None
        self._state: Literal["new", "starting", "running", "closing", "closed"] = "new"
        self._segs: dict[int, Seg] = {}
        #: segments changed since the last checkpoint
        self._dirty: set[int] = set()
        #: entries written since the last checkpoint
        self._pending = 0
        #: live bytes of each entry log (as the index last committed them)
        self._live: dict[int, int] = {}
        self._lock_fds: list[int] = []
        self._read_only: str | None = None
        self._read_only_sticky = False
        self._collecting = JournalRound()
        #: held by the round in flight (see ``JournalStore._flush_round``)
        self._round_lock = trio.StrictFIFOLock()
        #: the group commit's threads: the journal's fdatasync, the entry-log writes
        self._sync_thread = FlushThread("pigeon-journal-sync")
        self._log_thread = FlushThread("pigeon-journal-logs")
        #: small rounds run on the event loop (no thread hop) while the disk is fast
        self._inline = InlineSyncs(journal_inline_sync_max_bytes, journal_inline_sync_max_ms / 1000)
        #: payloads of the entries whose entry-log write a round has not done yet,
        #: by (log, offset) of their record: reads take them from here
        self._unwritten: dict[tuple[int, int], Buffer] = {}
        #: entry-log writes that failed: those entries are only in the journal (and in
        #: ``_unwritten``), so no checkpoint may let the journal go before they are
        #: written (each checkpoint tries them again)
        self._failed_writes: list[LogWrite] = []
        self._flush_wanted = trio.Event()
        #: the flusher task runs (else a forced round is flushed by its caller)
        self._flusher_running = False
        self._checkpoint_wanted = trio.Event()
        self._index_lock = trio.Lock()
        self._counters = Counters()
        #: checkpoints done since the start (the one after a replay not counted)
        self.checkpoints = 0
        #: take a checkpoint when stopping (tests turn it off to stop like a crash
        #: after the last fsync)
        self._checkpoint_on_close = True
        self.compacted_logs = 0

    def _check_running(self) -> None:
        if self._state != "running":
            raise ServiceUnavailable(f"journal store is {self._state}")

    def _get(self, segment_id: int) -> Seg:
        self._check_running()
        seg = self._segs.get(segment_id)
        if seg is None:
            raise SegmentNotFound(f"segment={segment_id} not found")
        return seg
