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
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from pigeon.bookie._journal_format import (
    FILE_HEADER_SIZE,
    JOURNAL_MAGIC,
    MAX_FILE_ID,
    JournalRecord,
    encode_file_header,
    parse_file_header,
    scan_journal,
)
from pigeon.bookie._segment import Buffer
from pigeon.bookie._storage_state import pwritev_all

__all__ = ["Journal", "JournalFile", "journal_name"]

logger = logging.getLogger("pigeon.bookie._journal")


def journal_name(seq: int) -> str:
    return f"{seq:016x}.txn"


class JournalFile:
    __slots__ = ("end", "fd", "path", "seq")

    def __init__(self, seq: int, path: Path, fd: int, end: int) -> None:
        self.seq = seq
        self.path = path
        self.fd = fd
        self.end = end


class Journal:
    """The journal files under ``directory``; ``max_size`` bytes a file."""

    def __init__(self, directory: Path, max_size: int) -> None:
        self.dir = directory
        self._max_size = max_size
        self.files: dict[int, JournalFile] = {}
        self.current: JournalFile | None = None
        #: a file was created since the last group commit: the directory needs a sync
        self.dir_dirty = False
        #: files whose torn tail was dropped at start
        self.torn_tails = 0
        self.dir_fd = -1

    # ------------------------------------------------------------------ start

    def open_files(self) -> list[JournalFile]:
        """Blocking: the journal files found, in order."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        found = []
        for entry in os.scandir(self.dir):
            stem, _dot, suffix = entry.name.partition(".")
            if suffix != "txn" or len(stem) != 16:
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
        found.sort(key=lambda f: f.seq)
        self.files = {f.seq: f for f in found}
        return found

    def replay(self, start: tuple[int, int] | None) -> Iterator[JournalRecord]:
        """Blocking: the intact records from ``start`` (a checkpoint position; None:
        from the beginning) in order.  A torn record ends its file (cut there when it
        is the last file; an ERROR when it is not: the records after it are lost)."""
        files = sorted(self.files.values(), key=lambda f: f.seq)
        for i, jf in enumerate(files):
            if start is not None and jf.seq < start[0]:
                continue
            pos = FILE_HEADER_SIZE
            if start is not None and jf.seq == start[0]:
                pos = max(pos, start[1])
            stop = jf.end
            for item in scan_journal(functools.partial(_pread, jf.fd), pos, jf.end):
                if isinstance(item, int):
                    stop = item
                else:
                    yield item
            if stop < jf.end:
                self.torn_tails += 1
                if i == len(files) - 1:
                    logger.warning(
                        "journal torn tail truncated file=%s at=%d dropped_bytes=%d",
                        jf.path.name,
                        stop,
                        jf.end - stop,
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
        """Blocking: create the next journal file and make it current."""
        seq = max(self.files, default=-1) + 1
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
        self.current = jf
        self.dir_dirty = True
        return jf

    # ------------------------------------------------------------------ writes

    def write(self, bufs: list[Buffer], total: int) -> JournalFile:
        """Append ``bufs`` to the current file (rolling afterwards when it is full);
        returns the file written, for the group commit.  Raises OSError (a partial
        write is cut off again)."""
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
            raise
        jf.end = start + total
        if jf.end >= self._max_size:
            self.start_new_file()
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
        return sum(f.end for f in self.files.values())

    def close(self) -> None:
        for f in self.files.values():
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
