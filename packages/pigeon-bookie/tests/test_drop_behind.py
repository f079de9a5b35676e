"""Drop-behind: written data leaves the page cache once durable (both ledger storages),
but for the last ``page_cache_window_bytes`` of each data file, and the journal's pages
(``journal_remove_pages_from_cache``); reads still return every entry."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import trio
from test_journal import open_store as open_journal_store
from test_storage import open_store as open_segment_store

MIB = 1 << 20
ENTRY = 256 * 1024
#: 16 MiB written: well past one drop step (4 MiB) beyond a 1 MiB window
ENTRIES = 64


_libc = ctypes.CDLL(None, use_errno=True)


def page_cached(path: Path, offset: int) -> bool:
    """Is the page of ``path`` at ``offset`` in the page cache?  (``mincore`` of a
    mapping of the file: looking does not read anything in, as a read would.)"""
    page = mmap.PAGESIZE
    start = offset - offset % page
    length = min(page, path.stat().st_size - start)
    with (
        open(path, "rb") as f,
        mmap.mmap(f.fileno(), length, access=mmap.ACCESS_COPY, offset=start) as m,
    ):
        view = ctypes.c_char.from_buffer(m)  # never written: the file's own pages
        vec = ctypes.create_string_buffer(1)
        rc = _libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(length), vec)
        del view
        if rc != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return bool(vec.raw[0] & 1)


@pytest.fixture
def dropping_fs(tmp_path: Path) -> Path:
    """``tmp_path``, if its file system drops clean pages on request and tells which
    pages are cached (Linux; not tmpfs); else the test is skipped."""
    if not sys.platform.startswith("linux"):
        pytest.skip("needs mincore and posix_fadvise (Linux)")
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, os.urandom(64 * 1024))
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    dropped = not page_cached(probe, 0)
    probe.unlink()
    if not dropped:
        pytest.skip("this file system keeps pages in memory whatever we ask")
    return tmp_path


def payload(i: int) -> bytes:
    return bytes([i % 251]) * ENTRY


async def fill(store: Any) -> None:
    """Segment 1 gets ENTRIES entries, each acknowledged (fsync=always) before the next."""
    for i in range(ENTRIES):
        await store.add_entry(1, i, payload(i))


def running_journal(path: Path, **options: Any) -> AbstractAsyncContextManager[Any]:
    """A running journal store: fsync=always, no checkpoint, no preallocated journal."""
    return open_journal_store(
        path, fsync="always", flush_interval_ms=1e9, journal_pre_alloc_size_mb=0, **options
    )


def check_read_back(store: Any) -> None:
    got = store.read_entries(1, 0, ENTRIES - 1, max_bytes=1 << 30)
    assert [(i, bytes(p)) for i, p in got] == [(i, payload(i)) for i in range(ENTRIES)]


async def test_segment_file_pages_leave_the_cache_once_durable(dropping_fs: Path) -> None:
    async with open_segment_store(
        dropping_fs, fsync="always", page_cache_window_bytes=MIB
    ) as store:
        await fill(store)
        data = dropping_fs / "segments" / f"{1:016x}.log"
        end = data.stat().st_size
        # everything but the last window (and one drop step) is out of the cache ...
        for offset in (0, 4 * MIB, end - 6 * MIB):
            assert not page_cached(data, offset), offset
        # ... the most recent bytes are still there, and every entry reads back
        assert page_cached(data, end - 64 * 1024)
        check_read_back(store)


async def test_segment_file_pages_stay_with_window_off(dropping_fs: Path) -> None:
    async with open_segment_store(dropping_fs, fsync="always", page_cache_window_bytes=-1) as store:
        await fill(store)
        data = dropping_fs / "segments" / f"{1:016x}.log"
        assert store.statistics().fsyncs >= 1
        # nothing asked the kernel to drop them (it may still evict: only the count of
        # pages it kept is not asserted, one early page is)
        assert page_cached(data, 4 * MIB) or page_cached(data, 8 * MIB)


async def test_journal_and_entry_log_pages_leave_the_cache(dropping_fs: Path) -> None:
    async with running_journal(
        dropping_fs, flush_entrylog_bytes=MIB, page_cache_window_bytes=MIB
    ) as store:
        await fill(store)
        await store.wait_written_behind()
        (journal,) = sorted((dropping_fs / "journal").glob("*.txn"))
        (log,) = sorted((dropping_fs / "ledgers").glob("*.log"))
        # the journal's pages go after each round's fdatasync ...
        end = journal.stat().st_size
        for offset in (0, 4 * MIB, end - 8 * MIB):
            assert not page_cached(journal, offset), offset
        # ... the entry log's after its write-behind (best effort: see the next test)
        log_end = log.stat().st_size
        cached = [page_cached(log, offset) for offset in range(0, log_end - 6 * MIB, 256 * 1024)]
        assert sum(cached) <= len(cached) // 4, cached
        # the entry log keeps its last window cached (the journal is read only by a replay)
        assert page_cached(log, log.stat().st_size - 64 * 1024)
        check_read_back(store)


async def test_entry_log_pages_leave_the_cache_with_adds_in_flight(dropping_fs: Path) -> None:
    """As the bookie's service adds (``append``, the next before the last is durable):
    with fsync=always a round writes the entry log after the add reserved its place;
    what is written behind and dropped is what was written, never a reserved range."""
    async with running_journal(
        dropping_fs, flush_entrylog_bytes=MIB, page_cache_window_bytes=MIB
    ) as store:
        waiters = []
        for i in range(ENTRIES):
            waiters.append(store.append(1, i, payload(i)))
            if i % 8 == 7:
                await trio.lowlevel.checkpoint()
        for waiter in waiters:
            await waiter.wait()
        await store.wait_written_behind()
        (log,) = sorted((dropping_fs / "ledgers").glob("*.log"))
        end = log.stat().st_size
        assert store.write_behinds >= 1
        cached = [page_cached(log, offset) for offset in range(0, end - 6 * MIB, 256 * 1024)]
        # the write-behind's sync_file_range is best effort: a page it left dirty stays
        # cached until a later drop, so a few may be left; with the ranges reserved but
        # not yet written dropped instead, nearly all of them were
        assert sum(cached) <= len(cached) // 4, cached
        check_read_back(store)


async def test_journal_pages_stay_when_asked(dropping_fs: Path) -> None:
    async with running_journal(
        dropping_fs, journal_remove_pages_from_cache=False, page_cache_window_bytes=-1
    ) as store:
        await fill(store)
        (journal,) = sorted((dropping_fs / "journal").glob("*.txn"))
        assert page_cached(journal, 4 * MIB) or page_cached(journal, 8 * MIB)
