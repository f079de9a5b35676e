"""The journal of the ``journal`` ledger storage: one append-only file sequence shared
by every segment.

Every record the store accepts (entries of all segments, fences, deletions) is appended
to the current journal file in the trio thread (a page-cache write); the group commit
fdatasyncs the files written since its previous round, one call for any number of adds.
A file rolls once past ``journal_max_size_mb``; files wholly before the position a
checkpoint recorded are deleted by :meth:`Journal.delete_before`.

At start, :meth:`Journal.replay` reads the records after the checkpoint back, in order;
the first torn record of the last file ends it (the file is cut there); writing then
goes on in a new file.

**Preallocation** (``journal_pre_alloc_size_mb``, BookKeeper's ``journalPreAllocSizeMB``).
An fdatasync that follows a write *appending* to a file must commit metadata (the new
size, the new blocks): a jbd2 transaction on ext4, which also waits for whatever else
that transaction carries (the checkpoint's entry-log writeback: the p99 stalls of the
ack path).  Overwriting blocks already allocated and written needs no metadata: the
fdatasync only writes the data.  So every journal file but the first after a start is
*prepared* before it is used: created, its header written and fdatasynced, then filled
with zeros to ``pre_alloc_size`` bytes (a MiB at a time, each fdatasynced), and the
directory fsynced -- in a thread of its own, while the writes go to the current file.
Writing then only overwrites zeros: the group commit's fdatasync commits no metadata.
A prepared file is named ``<seq>.pre`` and renamed ``<seq>.txn`` when it becomes
current; both names are journal files to :meth:`Journal.open_files`, and the directory
entry is durable (under the first name) before any record is in the file, so the
round that first writes a prepared file needs no directory fsync (``dir_dirty`` is
left alone) and the rename is never waited for.

How it goes: the first write to a new current file starts the preparation of the next
one (an idle store prepares nothing).  A write that would not fit in the zeros of the
current file moves to the next file when it is ready (the rest of the current one
stays zeros); when it is not (the writes outran the preparation), the write appends to
the current file, as without preallocation, and the next write tries again.  A file
thus rolls at ``min(journal_pre_alloc_size_mb, journal_max_size_mb)`` in the steady
state: the zeros are written once per byte of journal, in the background, never on the
ack path.  The first file after a start is created with its header alone (a start does
not wait for zeros) and is left as soon as the next file is ready.  A preparation that
fails (a full disk) is logged; the journal then rolls as without preallocation.
Zero-filling doubles the journal's disk writes, so it adapts: a file that was written
faster than ``PRE_ALLOC_MAX_RATE`` (64 MiB/s) is followed by one that is not prepared
(the journal appends, rolling at ``journal_max_size_mb``), a slower one by a prepared
one again -- the metadata an append commits weighs on small rounds (latency), hardly
on the large rounds of a fast stream, whose bandwidth the zeros would take.

Why zeros and not reused files (BookKeeper's ``journalReuseFiles``): a reused file is
full of intact records of its previous life, which a replay must never apply; telling
them apart needs a per-file salt in every record's checksum, so journal records would
no longer be the entry log's bytes (one header encoded per entry and per copy, on the
hot path), and a file is only reused after a checkpoint deleted one.  Zeros keep the
record format, and a zero byte never starts a record (every magic starts with 0xd7).

**Logical end.**  ``JournalFile.end`` is where the next record goes: what
:meth:`Journal.position` returns and :meth:`Journal.disk_usage` counts; the zeros after
it are ``JournalFile.allocated - end`` bytes.  Replay finds the logical end of each
file by scanning: the records end at the first one that does not parse; if every byte
from there to the end of the file is zero, that is a clean end (not a torn tail, not
logged); otherwise the rest is a torn record, counted in ``torn_tails`` and, when no
later file holds a record (the next file may have been prepared, and be all zeros), cut
off.  Zeros can never hide a record that was fsynced: records are written in order,
and an fdatasync covers every byte before the position it was asked for.

**Clean shutdown** (:meth:`Journal.close`) stops a preparation in progress, removes the
prepared file not used, and truncates the current file at its logical end: the
directory holds what it would hold without preallocation.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pigeon.bookie._journal_format import (
    FILE_HEADER_SIZE,
    JOURNAL_MAGIC,
    MAX_FILE_ID,
    RECORD_HEADER_SIZE,
    ZEROS,
    JournalRecord,
    all_zeros,
    encode_file_header,
    parse_file_header,
    parse_header,
    scan_journal,
)
from pigeon.bookie._segment import Buffer
from pigeon.bookie._storage_state import pwritev_all

__all__ = ["DEFAULT_PRE_ALLOC_SIZE", "PRE_ALLOC_MAX_RATE", "Journal", "JournalFile", "journal_name"]

logger = logging.getLogger("pigeon.bookie._journal")

#: ``journal_pre_alloc_size_mb``'s default (BookKeeper's is 16 MiB too)
DEFAULT_PRE_ALLOC_SIZE = 16 << 20
#: bytes/s: a journal file written faster than this is followed by one that is not
#: zero-filled (the zeros would double the journal's disk writes just when it needs
#: the bandwidth; at such rates a round's data dwarfs its metadata), a slower one by
#: a zero-filled one again
PRE_ALLOC_MAX_RATE = 64 << 20


def journal_name(seq: int) -> str:
    return f"{seq:016x}.txn"


def _prepared_name(seq: int) -> str:
    """The name of a journal file while it is prepared, until it becomes current."""
    return f"{seq:016x}.pre"


class JournalFile:
    """One journal file: ``end`` is its logical end (where the next record goes),
    ``allocated`` the bytes from its start that were written and made durable before
    it was used (its header and the zeros after it): writes below that commit no
    metadata."""

    __slots__ = ("allocated", "cached_from", "end", "fd", "path", "seq")

    def __init__(self, seq: int, path: Path, fd: int, end: int, allocated: int = 0) -> None:
        self.seq = seq
        self.path = path
        self.fd = fd
        self.end = end
        self.allocated = allocated
        #: pages before this offset were dropped from the page cache once durable
        #: (``journal_remove_pages_from_cache``)
        self.cached_from = 0


class _Preparation:
    """The next journal file, being created and zero-filled by a thread of its own."""

    __slots__ = ("done", "error", "file", "seq", "stop", "thread")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.stop = threading.Event()
        #: set by the thread once ``file`` or ``error`` is
        self.done = threading.Event()
        self.file: JournalFile | None = None
        self.error: OSError | None = None
        self.thread: threading.Thread | None = None


class _Stopped(Exception):
    pass


class Journal:
    """The journal files under ``directory``; ``max_size`` bytes a file; each file
    zero-filled to ``pre_alloc_size`` bytes before it is used (0: never)."""

    def __init__(
        self, directory: Path, max_size: int, pre_alloc_size: int = DEFAULT_PRE_ALLOC_SIZE
    ) -> None:
        self.dir = directory
        self._max_size = max_size
        #: the size a prepared file is zero-filled to (0: no preallocation)
        self._pre_alloc = min(pre_alloc_size, max_size) if pre_alloc_size > 0 else 0
        self.files: dict[int, JournalFile] = {}
        self.current: JournalFile | None = None
        #: a file was created since the last group commit: the directory needs a sync
        self.dir_dirty = False
        #: files whose torn tail was dropped at start
        self.torn_tails = 0
        self.dir_fd = -1
        self._prep: _Preparation | None = None
        #: the current file's seq once the preparation of its successor was started
        #: (one attempt per file: a failing disk does not start a thread per write)
        self._prepared_after = -1
        #: the lowest seq not handed out yet
        self._next_seq = 0
        #: when the current file became current (monotonic clock)
        self._current_since = time.monotonic()
        #: the previous file was written faster than PRE_ALLOC_MAX_RATE: the next one
        #: is not zero-filled
        self._fast = False

    # ------------------------------------------------------------------ start

    def open_files(self) -> list[JournalFile]:
        """Blocking: the journal files found, in order."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        found = []
        for entry in os.scandir(self.dir):
            stem, _dot, suffix = entry.name.partition(".")
            if suffix not in ("txn", "pre") or len(stem) != 16:
                continue
            try:
                seq = int(stem, 16)
            except ValueError:
                continue
            if seq > MAX_FILE_ID:  # a number this store never reaches: not its file
                logger.warning("stray file ignored path=%s", entry.path)
                continue
            fd = os.open(entry.path, os.O_RDWR | os.O_CLOEXEC)
            jf = JournalFile(seq, Path(entry.path), fd, os.fstat(fd).st_size)
            if parse_file_header(os.pread(fd, FILE_HEADER_SIZE, 0), JOURNAL_MAGIC) != seq:
                if jf.end <= FILE_HEADER_SIZE:
                    # a file created but never written (crash): nothing in it
                    logger.warning("journal file without header removed path=%s", jf.path)
                    os.close(fd)
                    jf.path.unlink()
                    continue
                # a damaged header: the records after it carry their own checksums
                logger.error("journal file header damaged path=%s: replayed by its name", jf.path)
            found.append(jf)
        # ".txn" before ".pre": a prepared file whose removal failed (its preparation
        # did) may share its seq with a file created after it; only the ".txn" one
        # can hold records (a prepared file is renamed before it is written)
        found.sort(key=lambda f: (f.seq, f.path.suffix != ".txn"))
        self.files = {}
        for jf in found:
            if jf.seq in self.files:
                logger.warning("journal file ignored path=%s: its seq is taken", jf.path)
                os.close(jf.fd)
            else:
                self.files[jf.seq] = jf
        self._next_seq = max(self.files, default=-1) + 1
        return list(self.files.values())

    def replay(self, start: tuple[int, int] | None) -> Iterator[JournalRecord]:
        """Blocking: the intact records from ``start`` (a checkpoint position; None:
        from the beginning) in order.  Zeros after a file's records are its clean end
        (preallocated, never written).  A torn record ends its file (cut there when no
        later file holds a record; an ERROR when one does: the records after it are
        lost)."""
        files = sorted(self.files.values(), key=lambda f: f.seq)
        for i, jf in enumerate(files):
            if start is not None and jf.seq < start[0]:
                continue
            pos = FILE_HEADER_SIZE
            if start is not None and jf.seq == start[0]:
                pos = max(pos, start[1])
            read = functools.partial(_pread, jf.fd)
            size = jf.end  # the file's size, as open_files found it
            stop = size
            for item in scan_journal(read, pos, size):
                if isinstance(item, int):
                    stop = item
                else:
                    yield item
            if stop >= size:
                continue
            if all_zeros(read, stop, size):
                jf.end, jf.allocated = stop, size
                continue
            self.torn_tails += 1
            if not any(_first_record_intact(f) for f in files[i + 1 :]):
                logger.warning(
                    "journal torn tail truncated file=%s at=%d dropped_bytes=%d",
                    jf.path.name,
                    stop,
                    size - stop,
                )
                os.ftruncate(jf.fd, stop)
                os.fsync(jf.fd)
                jf.end = stop
            else:
                logger.error(
                    "journal damaged file=%s at=%d: records after it are lost",
                    jf.path.name,
                    stop,
                )

    def start_new_file(self) -> JournalFile:
        """Blocking: make the next journal file current: the prepared one (waiting for
        its preparation if one runs), else a new file with its header alone."""
        if self._take_prepared(wait=True):
            assert self.current is not None
            return self.current
        seq = self._new_seq()
        path = self.dir / journal_name(seq)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.pwrite(fd, encode_file_header(JOURNAL_MAGIC, seq), 0)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        jf = JournalFile(seq, path, fd, FILE_HEADER_SIZE)
        self.files[seq] = jf
        self._make_current(jf)
        self.dir_dirty = True
        return jf

    # ------------------------------------------------------------------ preallocation

    def _prepare_next(self) -> None:
        """Start preparing the file after the current one, in a thread (once per
        current file)."""
        jf = self.current
        assert jf is not None
        if not self._pre_alloc or self._prep is not None or self._prepared_after == jf.seq:
            return
        self._prepared_after = jf.seq
        if self._fast:  # the zeros would take bandwidth the journal's writes need
            return
        prep = _Preparation(self._new_seq())
        prep.thread = threading.Thread(
            target=self._prepare,
            args=(prep,),
            name=f"pigeon-journal-prealloc-{prep.seq:x}",
            daemon=True,
        )
        self._prep = prep
        prep.thread.start()

    def _new_seq(self) -> int:
        """The next file's seq: never one handed out before (a failed preparation's
        file may be left behind under it)."""
        seq = max(self._next_seq, max(self.files, default=-1) + 1)
        self._next_seq = seq + 1
        return seq

    def _prepare(self, prep: _Preparation) -> None:
        """Thread: create journal file ``prep.seq``, header fdatasynced first (a crash
        leaves no file longer than its header without one), then zeros to the
        preallocation size a MiB at a time (each fdatasynced: short bursts of writes
        beside the group commit's), then the directory fsynced."""
        path = self.dir / _prepared_name(prep.seq)
        size = max(self._pre_alloc, FILE_HEADER_SIZE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            prep.error = exc
            prep.done.set()
            return
        try:
            os.pwrite(fd, encode_file_header(JOURNAL_MAGIC, prep.seq), 0)
            os.fdatasync(fd)
            zeros = memoryview(ZEROS)
            pos = FILE_HEADER_SIZE
            while pos < size:
                if prep.stop.is_set():
                    raise _Stopped
                n = min(len(zeros) - pos % len(zeros), size - pos)  # MiB-aligned pieces
                pos += os.pwrite(fd, zeros[:n], pos)
                os.fdatasync(fd)
            os.fsync(self.dir_fd)
        except (OSError, _Stopped) as exc:
            os.close(fd)
            try:
                path.unlink()
            except OSError:
                pass
            prep.error = exc if isinstance(exc, OSError) else None
        else:
            prep.file = JournalFile(prep.seq, path, fd, FILE_HEADER_SIZE, size)
        prep.done.set()

    def _take_prepared(self, *, wait: bool = False) -> bool:
        """Make the prepared file current if it is ready (``wait``: once its
        preparation ends); False if there is none (failed, or still running)."""
        prep = self._prep
        if prep is None or not (prep.done.is_set() or wait):
            return False
        assert prep.thread is not None
        prep.thread.join()
        self._prep = None
        if prep.file is None:
            logger.warning(
                "journal file %s not preallocated (%s): the journal appends",
                _prepared_name(prep.seq),
                prep.error,
            )
            return False
        jf = prep.file
        path = jf.path.with_name(journal_name(jf.seq))
        try:
            os.rename(jf.path, path)
            jf.path = path
        except OSError as exc:  # the name is cosmetic: a ".pre" file is replayed too
            logger.warning("journal file %s not renamed: %s", jf.path, exc)
        self.files[jf.seq] = jf
        self._make_current(jf)
        return True

    def _make_current(self, jf: JournalFile) -> None:
        """``jf`` takes the writes from now on; the rate the previous file was
        written at decides whether the next one is zero-filled (:data:`PRE_ALLOC_MAX_RATE`)."""
        now = time.monotonic()
        old = self.current
        written = old.end - FILE_HEADER_SIZE if old is not None else 0
        # a file left early (the first after a start) says nothing of the rate
        if old is not None and old is not jf and written >= self._pre_alloc // 2:
            elapsed = now - self._current_since
            self._fast = elapsed <= 0 or written / elapsed > PRE_ALLOC_MAX_RATE
        self.current = jf
        self._current_since = now

    # ------------------------------------------------------------------ writes

    def write(self, bufs: list[Buffer], total: int) -> JournalFile:
        """Append ``bufs`` to the current file (moving first to the prepared next file
        when they do not fit in the current one's zeros, rolling afterwards when it is
        full); returns the file written, for the group commit.  Raises OSError (a
        partial write is cut off again)."""
        jf = self.current
        assert jf is not None
        start = jf.end
        if start + total > jf.allocated and start > FILE_HEADER_SIZE and self._take_prepared():
            jf = self.current
            assert jf is not None
            start = jf.end
        try:
            pwritev_all(jf.fd, bufs, start, total)
        except OSError:
            try:
                os.ftruncate(jf.fd, start)
            except OSError:
                pass
            jf.allocated = min(jf.allocated, start)
            raise
        jf.end = start + total
        if jf.end >= self._max_size and not self._take_prepared() and self._prep is None:
            self.start_new_file()
        if self._prep is None and self._pre_alloc:  # (a prepared file waits: not None)
            self._prepare_next()
        return jf

    def position(self) -> tuple[int, int]:
        """Where the next record goes: everything before it has been written."""
        jf = self.current
        assert jf is not None
        return jf.seq, jf.end

    def sync_dir(self) -> None:
        os.fsync(self.dir_fd)

    def delete_before(self, seq: int) -> list[JournalFile]:
        """Forget the files before ``seq`` (a checkpoint covers them); the caller
        closes and unlinks the returned files."""
        old = [f for s, f in self.files.items() if s < seq]
        for f in old:
            del self.files[f.seq]
        return old

    def disk_usage(self) -> int:
        """The bytes of the journal's records (preallocated zeros not counted)."""
        return sum(f.end for f in self.files.values())

    def close(self) -> None:
        """Stop a preparation (its file removed), cut the zeros after the files'
        logical ends, close the files."""
        prep, self._prep = self._prep, None
        if prep is not None:
            prep.stop.set()
            assert prep.thread is not None
            prep.thread.join()
            if prep.file is not None:
                os.close(prep.file.fd)
                prep.file.path.unlink(missing_ok=True)
        for f in self.files.values():
            try:
                if f.allocated > f.end:
                    os.ftruncate(f.fd, f.end)
            except OSError:
                pass  # the zeros stay: a replay reads them as the file's clean end
            try:
                os.close(f.fd)
            except OSError:
                pass
        self.files.clear()
        self.current = None
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1


def _pread(fd: int, pos: int, n: int) -> bytes:
    return os.pread(fd, n, pos)


def _first_record_intact(jf: JournalFile) -> bool:
    """Does the file's first record have an intact header (the file holds records)?"""
    return parse_header(os.pread(jf.fd, RECORD_HEADER_SIZE, FILE_HEADER_SIZE), 0) is not None
