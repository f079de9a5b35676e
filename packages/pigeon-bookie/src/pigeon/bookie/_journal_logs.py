"""Entry logs of the ``journal`` ledger storage: interleaved files of entry records.

Every add goes at the end of the *current* entry log, whatever its segment: written at
once (trio thread, page cache), or, with ``fsync=always``, reserved (:meth:`EntryLogs.reserve`)
and written by the group-commit round in a worker thread (:func:`write_reserved`) beside
the journal's fdatasync.  The log rolls to a new file once past ``entry_log_size_limit``.
New logs go to the ledger directories in turn.  Nothing here fsyncs on the ack path:
the checkpoint fsyncs the logs written since the previous one (:meth:`EntryLogs.take_dirty`).

**Write-behind** (``flush_entrylog_bytes``, BookKeeper's ``flushEntrylogBytes``): once a
log has that many bytes written since its last write-behind, the store's write-behind
task has the kernel write them to disk in a worker thread (:func:`write_behind`: on
Linux ``sync_file_range`` over that range, in pieces of :data:`WRITE_BEHIND_PIECE`
bytes, each waited for, so that no more than one piece of entry-log data is queued
before the journal's fdatasync; elsewhere one ``fdatasync``).  Without it the pages of
a whole checkpoint interval stay dirty until the checkpoint's fdatasync, which then
holds up the journal's fdatasyncs behind gigabytes on a shared disk.  It only starts
writeback early: durability is still the checkpoint's fdatasync (bytes of a round still
in flight when a range is taken are left to it).
A log stays open for reads until it is deleted (compaction), and its descriptor is
closed only once no read in a worker thread uses it any more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pigeon.bookie._journal_format import (
    FILE_HEADER_SIZE,
    LOG_MAGIC,
    MAX_FILE_ID,
    encode_file_header,
)
from pigeon.bookie._segment import Buffer
from pigeon.bookie._storage_state import (
    DROP_BEHIND_STEP,
    DropBehind,
    drop_behind,
    next_drop,
    pwritev_all,
)

__all__ = [
    "EntryLog",
    "EntryLogs",
    "LogWrite",
    "WriteBehind",
    "log_name",
    "write_behind",
    "write_reserved",
]

logger = logging.getLogger("pigeon.bookie._journal")

#: the most entry-log bytes one write-behind call queues for the disk at a time
WRITE_BEHIND_PIECE = 4 << 20
# sync_file_range(2) flags
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def log_name(log_id: int) -> str:
    return f"{log_id:016x}.log"


class EntryLog:
    """One entry log file; mutated only from the trio thread (``end``, ``refs``)."""

    __slots__ = (
        "behind",
        "cached_from",
        "dir_index",
        "end",
        "fd",
        "id",
        "path",
        "refs",
        "retired",
        "written",
    )

    def __init__(self, log_id: int, path: Path, fd: int, end: int, dir_index: int) -> None:
        self.id = log_id
        self.path = path
        self.fd = fd
        self.end = end
        self.dir_index = dir_index
        #: where the next write-behind starts (everything before it was handed to one)
        self.behind = end
        #: the end of what is written (``end`` also counts bytes reserved for a round
        #: that has not written them yet: write-behind and drops stop here)
        self.written = end
        #: pages before this offset were dropped from the page cache once written
        #: behind (``page_cache_window_bytes``)
        self.cached_from = end
        #: worker threads reading it: the descriptor is closed only at 0
        self.refs = 0
        self.retired = False

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0 and self.retired:
            _close(self.fd)


#: a reserved write: ``(log, offset, buffers, total bytes)``
LogWrite = tuple[EntryLog, int, list[Buffer], int]
#: a range to write behind: ``(log, start, end)``; the log is held (``refs``) until the
#: caller releases it
WriteBehind = tuple[EntryLog, int, int]


def write_behind(ranges: list[WriteBehind], drops: Sequence[DropBehind] = ()) -> None:
    """Blocking (a worker thread): have the kernel write these ranges of entry logs to
    disk now (see the module doc), then drop ``drops`` (ranges of these logs written
    behind, by this call or earlier ones) from the page cache; raises OSError."""
    fn = _sync_file_range
    for log, start, end in ranges:
        if fn is None:
            os.fsync(log.fd)
            continue
        pos = start
        while pos < end:
            n = min(WRITE_BEHIND_PIECE, end - pos)
            if fn(log.fd, pos, n, _WAIT_BEFORE | _WRITE | _WAIT_AFTER) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            pos += n
    if drops:
        drop_behind(list(drops))


def write_reserved(writes: list[LogWrite]) -> OSError | None:
    """Blocking (a worker thread, or the trio thread for a few): the reserved writes,
    in order, those that follow each other in one log as one vectored write; the first
    failure stops them and is returned."""
    try:
        i = 0
        n = len(writes)
        while i < n:
            log, offset, bufs, total = writes[i]
            i += 1
            if i < n and writes[i][0] is log and writes[i][1] == offset + total:
                bufs = list(bufs)
                while i < n and writes[i][0] is log and writes[i][1] == offset + total:
                    bufs += writes[i][2]
                    total += writes[i][3]
                    i += 1
            pwritev_all(log.fd, bufs, offset, total)
    except OSError as exc:
        return exc
    return None


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class EntryLogs:
    """The entry logs under ``dirs``; ``size_limit`` bytes a log before it rolls."""

    def __init__(
        self, dirs: list[Path], size_limit: int, flush_bytes: int = 0, cache_window: int = -1
    ) -> None:
        """``flush_bytes``: write behind every that many bytes of a log (0: never);
        ``cache_window``: of each log, the bytes before the end that stay in the page
        cache once written behind (-1: all)."""
        self._dirs = dirs
        self._size_limit = size_limit
        self._flush_bytes = flush_bytes
        self._cache_window = cache_window
        #: a log has ``flush_bytes`` to write behind (see :meth:`take_write_behind`)
        self.write_behind_due = False
        self.logs: dict[int, EntryLog] = {}
        self.current: EntryLog | None = None
        self._dirty: dict[int, EntryLog] = {}
        self._dirty_dirs: set[int] = set()
        self._next_id = 0

    def open(self) -> None:
        """Blocking: open every entry log found, start a new current one."""
        for i, d in enumerate(self._dirs):
            d.mkdir(parents=True, exist_ok=True)
            for entry in os.scandir(d):
                stem, _dot, suffix = entry.name.partition(".")
                if suffix == "log.tmp":
                    os.unlink(entry.path)  # a compaction that did not finish
                    continue
                if suffix != "log" or len(stem) != 16:
                    continue
                try:
                    log_id = int(stem, 16)
                except ValueError:
                    continue
                if log_id > MAX_FILE_ID:  # an id this store never reaches: not its file
                    logger.warning("stray file ignored path=%s", entry.path)
                    continue
                fd = os.open(entry.path, os.O_RDWR | os.O_CLOEXEC)
                self.logs[log_id] = EntryLog(log_id, Path(entry.path), fd, os.fstat(fd).st_size, i)
                self._next_id = max(self._next_id, log_id + 1)
        self.current = self.new_log()

    def new_log(self) -> EntryLog:
        """Blocking: create the next entry log (its directory synced at the checkpoint)."""
        log_id = self._next_id
        self._next_id += 1
        i = log_id % len(self._dirs)
        path = self._dirs[i] / log_name(log_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.pwrite(fd, encode_file_header(LOG_MAGIC, log_id), 0)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        log = EntryLog(log_id, path, fd, FILE_HEADER_SIZE, i)
        self.logs[log_id] = log
        self._dirty[log_id] = log
        self._dirty_dirs.add(i)
        return log

    def write(self, bufs: list[Buffer], total: int) -> tuple[int, int]:
        """Append ``bufs`` to the current log: ``(log id, offset)`` where they start.
        Raises OSError (a partial write is cut off again)."""
        log = self.current
        assert log is not None
        start = log.end
        try:
            pwritev_all(log.fd, bufs, start, total)
        except OSError:
            try:
                os.ftruncate(log.fd, start)
            except OSError:
                pass
            raise
        self._advance(log, total)
        self.written_up_to(log, start + total)
        return log.id, start

    def reserve(self, total: int) -> tuple[EntryLog, int]:
        """Room for ``total`` bytes at the end of the current log, written later by
        the caller (:func:`write_reserved`, in a worker thread): ``(log, offset)``.
        Raises OSError (the next log cannot be created)."""
        log = self.current
        assert log is not None
        start = log.end
        self._advance(log, total)
        return log, start

    def _advance(self, log: EntryLog, total: int) -> None:
        log.end += total
        self._dirty[log.id] = log
        if log.end >= self._size_limit:
            self.current = self.new_log()

    def written_up_to(self, log: EntryLog, end: int) -> None:
        """The bytes of ``log`` before ``end`` are written (a reserved write done)."""
        if end > log.written:
            log.written = end
        if self._flush_bytes and log.written - log.behind >= self._flush_bytes:
            self.write_behind_due = True

    def take_write_behind(self) -> tuple[list[WriteBehind], list[DropBehind]]:
        """The ranges to write behind now: of every log written since the last
        checkpoint, what was written since its last write-behind (of the current log
        only once that is ``flush_bytes``; bytes reserved but not written yet wait for
        the next time); and the ranges of these logs to drop from the page cache after
        that (more than ``cache_window`` before the end of what is written).  Each
        log is held (``refs``): the caller calls ``log.release()`` once
        :func:`write_behind` is done with it."""
        self.write_behind_due = False
        out: list[WriteBehind] = []
        drops: list[DropBehind] = []
        window = self._cache_window
        for log in self._dirty.values():
            todo = log.written - log.behind
            if todo <= 0 or (log is self.current and todo < self._flush_bytes):
                continue
            out.append((log, log.behind, log.written))
            log.behind = log.written
            log.refs += 1
            # the last step again: sync_file_range is best effort (pages it left dirty
            # were not dropped then, and are written back by now)
            drop = next_drop(log, log.written, window, retry=DROP_BEHIND_STEP)
            if drop is not None:
                drops.append(drop)
        return out, drops

    def take_dirty(self) -> tuple[list[EntryLog], list[int]]:
        """The logs written and the directories changed since the previous call (the
        checkpoint fsyncs them); the current log stays dirty."""
        logs, self._dirty = list(self._dirty.values()), {}
        dirs, self._dirty_dirs = sorted(self._dirty_dirs), set()
        if self.current is not None:
            self._dirty[self.current.id] = self.current
        return logs, dirs

    def is_dirty(self, log: EntryLog) -> bool:
        """Written since the last checkpoint began: not all of it is indexed."""
        return log.id in self._dirty

    def mark_dirty(self, log: EntryLog) -> None:
        self._dirty[log.id] = log

    def sync(self, logs: list[EntryLog], dirs: list[int]) -> int:
        """Blocking: fdatasync ``logs`` and fsync the ledger directories ``dirs``;
        returns the fsyncs done."""
        for log in logs:
            os.fdatasync(log.fd)
        for i in dirs:
            self.sync_dir(i)
        return len(logs) + len(dirs)

    def sync_dir(self, i: int) -> None:
        fd = os.open(self._dirs[i], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def retire(self, log_id: int) -> EntryLog | None:
        """Forget a log (compaction): its file is unlinked by the caller, its
        descriptor closed once no reader uses it."""
        log = self.logs.pop(log_id, None)
        if log is None:
            return None
        self._dirty.pop(log_id, None)
        log.retired = True
        if log.refs == 0:
            _close(log.fd)
        return log

    def sealed(self) -> list[EntryLog]:
        """Logs no longer written (all but the current one)."""
        cur = self.current
        return [log for log in self.logs.values() if log is not cur]

    def disk_usage(self) -> int:
        return sum(log.end for log in self.logs.values())

    def close(self) -> None:
        for log in self.logs.values():
            if log.refs == 0:
                _close(log.fd)
            else:
                log.retired = True
        self.logs.clear()
        self.current = None

    def tmp_path(self, log_id: int) -> tuple[Path, int]:
        """Where compaction writes the log ``log_id`` before renaming it into place."""
        i = log_id % len(self._dirs)
        return self._dirs[i] / (log_name(log_id) + ".tmp"), i

    def reserve_id(self) -> int:
        log_id = self._next_id
        self._next_id += 1
        return log_id

    def adopt(self, log_id: int, path: Path, dir_index: int) -> EntryLog:
        """Blocking: open a log written by compaction (already fsynced, renamed)."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        log = EntryLog(log_id, path, fd, os.fstat(fd).st_size, dir_index)
        self.logs[log_id] = log
        return log
