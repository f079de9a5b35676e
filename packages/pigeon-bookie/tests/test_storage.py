"""SegmentStore: appends, reads, fencing, recovery, group commit."""

from __future__ import annotations

import errno
import os
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import pigeon.bookie._storage_commit as commit_mod
from pigeon.bookie._segment import FILE_HEADER_SIZE, RECORD_HEADER_SIZE, encode_record_header
from pigeon.bookie._storage import SegmentStore
from pigeon.core.errors import (
    BookieReadOnly,
    CorruptEntry,
    EntryNotFound,
    InvalidArgument,
    InvalidEntryId,
    SegmentFenced,
    SegmentNotFound,
    ServiceUnavailable,
    StorageError,
)


def payload(segment_id: int, entry_id: int, size: int | None = None) -> bytes:
    rng = random.Random(segment_id * 1_000_003 + entry_id)
    return rng.randbytes(rng.randrange(0, 3000) if size is None else size)


@asynccontextmanager
async def open_store(path: Path, **kw: Any) -> AsyncIterator[SegmentStore]:
    dense_window = kw.pop("dense_window", None)
    store = SegmentStore(path, **kw)
    if dense_window is not None:
        store._dense_window = dense_window
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        yield store
        nursery.cancel_scope.cancel()


def files(path: Path, segment_id: int) -> dict[str, Path]:
    base = path / "segments" / f"{segment_id:016x}"
    return {s: base.with_suffix("." + s) for s in ("log", "idx", "meta")}


async def fill(store: SegmentStore, segment_id: int, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        await store.add_entry(segment_id, i, payload(segment_id, i), lac=i - 1)


def check_all(store: SegmentStore, segment_id: int, n: int) -> None:
    got = store.read_entries(segment_id, 0, n - 1, max_count=n)
    assert [i for i, _ in got] == list(range(n))
    for i, p in got:
        assert p == payload(segment_id, i)


async def test_append_and_read_round_trip(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        sizes = [0, 1, 100, 5000, 300_000, 1 << 20, 7]
        for i, size in enumerate(sizes):
            await store.add_entry(3, i, payload(3, i, size))
        for i, size in enumerate(sizes):
            [(eid, data)] = store.read_entries(3, i, i)
            assert eid == i and data == payload(3, i, size) and len(data) == size
        got = await store.read_entries_async(3, 0, 100, max_bytes=64 << 20)
        assert [p for _, p in got] == [payload(3, i, s) for i, s in enumerate(sizes)]
        assert store.last_entry_id(3) == len(sizes) - 1
        assert store.segments() == [3]
        info = store.segment_info(3)
        assert info.entry_count == len(sizes)
        assert info.size_bytes == FILE_HEADER_SIZE + sum(sizes) + RECORD_HEADER_SIZE * len(sizes)
        assert not info.fenced


async def test_accepts_buffers(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        raw = b"0123456789"
        await store.add_entry(1, 0, bytearray(raw))
        await store.add_entry(1, 1, memoryview(raw)[2:5])
        await store.add_entry(1, 2, memoryview(raw))
        assert [p for _, p in store.read_entries(1, 0, 2)] == [raw, b"234", raw]
        with pytest.raises(InvalidArgument):
            await store.add_entry(1, 3, memoryview(raw)[::2])
        with pytest.raises(InvalidArgument):
            await store.add_entry(1, 3, "text")  # type: ignore[arg-type]
        assert store.last_entry_id(1) == 2


async def test_read_limits_and_errors(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        for i in range(20):
            await store.add_entry(1, i, bytes([i]) * 1000)
        assert [i for i, _ in store.read_entries(1, 5, 100)] == list(range(5, 20))
        assert [i for i, _ in store.read_entries(1, 5, 19, max_count=3)] == [5, 6, 7]
        assert [i for i, _ in store.read_entries(1, 5, 19, max_bytes=2500)] == [5, 6]
        assert [i for i, _ in store.read_entries(1, 5, 19, max_bytes=1)] == [5]
        assert [i for i, _ in store.read_entries(1, 19, 19)] == [19]
        with pytest.raises(EntryNotFound):
            store.read_entries(1, 20, 25)
        with pytest.raises(InvalidArgument):
            store.read_entries(1, 5, 4)
        with pytest.raises(InvalidArgument):
            store.read_entries(1, -1, 4)
        with pytest.raises(SegmentNotFound):
            store.read_entries(2, 0, 0)
        with pytest.raises(SegmentNotFound):
            store.last_entry_id(2)
        with pytest.raises(SegmentNotFound):
            store.segment_info(2)


async def test_entry_ids_must_increase(tmp_path: Path) -> None:
    """Ids may skip (striping, a replacement bookie) but never go back or repeat."""
    async with open_store(tmp_path) as store:
        await store.add_entry(1, 0, b"a")
        with pytest.raises(InvalidEntryId):
            await store.add_entry(1, 0, b"a")  # duplicate
        await store.add_entry(1, 1, b"b")
        with pytest.raises(InvalidEntryId):
            await store.add_entry(1, 0, b"z")  # below the last
        with pytest.raises(InvalidEntryId):
            await store.add_entry(1, -1, b"b")
        with pytest.raises(InvalidArgument):
            await store.add_entry(-5, 0, b"b")
        await store.add_entry(1, 3, b"d")  # a gap: entry 2 is not stored here
        with pytest.raises(InvalidEntryId):
            await store.add_entry(1, 2, b"c")  # a skipped id cannot be filled in later
        assert [p for _, p in store.read_entries(1, 0, 9)] == [b"a", b"b", b"d"]
        assert store.last_entry_id(1) == 3


async def test_batched_adds(tmp_path: Path) -> None:
    async with open_store(tmp_path, index_interval_bytes=500) as store:
        await store.add_entries(4, 0, [payload(4, i) for i in range(1500)], lac=3)
        await store.add_entries(4, 1500, [])
        with pytest.raises(InvalidEntryId):
            await store.add_entries(4, 1499, [b"x"])
        await store.add_entries(4, 1500, [payload(4, 1500)])
        check_all(store, 4, 1501)
        assert store.read_lac(4) == 3
    async with open_store(tmp_path, index_interval_bytes=500) as store:
        check_all(store, 4, 1501)


async def test_lac_is_the_max_piggybacked_and_survives_restart(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await store.add_entry(1, 0, b"a")
        assert store.read_lac(1) == -1
        await store.add_entry(1, 1, b"b", lac=0)
        await store.add_entry(1, 2, b"c", lac=1)
        assert store.read_lac(1) == 1
        assert store.segment_info(1).lac == 1
    async with open_store(tmp_path) as store:
        assert store.read_lac(1) == 1


async def test_fence(tmp_path: Path) -> None:
    async with open_store(tmp_path, fsync="never") as store:
        await fill(store, 1, 5)
        assert await store.fence(1) == 4
        with pytest.raises(SegmentFenced):
            await store.add_entry(1, 5, b"late")
        assert await store.fence(1) == 4  # idempotent
        assert store.segment_info(1).fenced
        check_all(store, 1, 5)  # reads still work
        # Fencing an unknown segment creates it fenced and empty: a late first add loses.
        assert await store.fence(2) == -1
        with pytest.raises(SegmentFenced):
            await store.add_entry(2, 0, b"first")
        assert store.segments() == [1, 2]
        assert files(tmp_path, 1)["meta"].exists()
    async with open_store(tmp_path) as store:
        assert store.segments() == [1, 2]
        assert store.segment_info(1).fenced and store.segment_info(2).fenced
        assert store.last_entry_id(1) == 4 and store.last_entry_id(2) == -1
        with pytest.raises(SegmentFenced):
            await store.add_entry(1, 5, b"late")
        with pytest.raises(SegmentFenced):
            await store.add_entry(2, 0, b"first")
        check_all(store, 1, 5)


async def test_recovery_adds(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 3)
        await store.fence(1)
        # BookKeeper's recovery adds pass the fence and are idempotent for equal bytes.
        await store.add_entry(1, 2, payload(1, 2), recovery=True)
        with pytest.raises(InvalidEntryId):
            await store.add_entry(1, 2, b"other bytes", recovery=True)
        await store.add_entry(1, 3, payload(1, 3), recovery=True)
        check_all(store, 1, 4)


async def test_restart_keeps_everything(tmp_path: Path) -> None:
    n = {1: 300, 2: 1, 3: 77}
    async with open_store(tmp_path, index_interval_bytes=1000) as store:
        for seg, count in n.items():
            await fill(store, seg, count)
        before = {seg: store.segment_info(seg) for seg in n}
    for _ in range(2):
        async with open_store(tmp_path, index_interval_bytes=1000) as store:
            assert store.segments() == sorted(n)
            for seg, count in n.items():
                assert store.segment_info(seg) == before[seg]
                check_all(store, seg, count)
                for i in random.Random(seg).sample(range(count), min(count, 20)):
                    assert store.read_entries(seg, i, i) == [(i, payload(seg, i))]
    async with open_store(tmp_path, index_interval_bytes=1000) as store:
        await fill(store, 2, 10, start=1)  # appends go on after a restart
    async with open_store(tmp_path, index_interval_bytes=1000) as store:
        check_all(store, 2, 11)


async def test_reads_beyond_the_dense_window_use_the_sparse_index(tmp_path: Path) -> None:
    async with open_store(tmp_path, index_interval_bytes=2000, dense_window=8) as store:
        await fill(store, 1, 200)
        seg = store._segments[1]
        assert seg.base > 150 and len(seg.starts) <= 16
        check_all(store, 1, 200)
        for i in range(200):
            assert store.read_entries(1, i, i) == [(i, payload(1, i))]
        got = await store.read_entries_async(1, 3, 150)
        assert got == [(i, payload(1, i)) for i in range(3, 151)]


async def test_torn_tail_is_truncated(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 10)
        size = store.segment_info(1).size_bytes
    log = files(tmp_path, 1)["log"]
    p = payload(1, 10, 5000)
    with log.open("ab") as f:  # a record whose write was cut short
        f.write(encode_record_header(1, 10, 9, p) + p[:1234])
    async with open_store(tmp_path) as store:
        assert store.last_entry_id(1) == 9
        assert log.stat().st_size == size
        await fill(store, 1, 5, start=10)
    with log.open("ab") as f:  # garbage after the last record
        f.write(os.urandom(777))
    async with open_store(tmp_path) as store:
        assert store.last_entry_id(1) == 14
        check_all(store, 1, 15)


async def test_bad_checksum_of_the_last_record_is_a_torn_tail(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 10)
    log = files(tmp_path, 1)["log"]
    data = bytearray(log.read_bytes())
    data[-1] ^= 0xFF
    log.write_bytes(data)
    async with open_store(tmp_path) as store:
        assert store.last_entry_id(1) == 8
        check_all(store, 1, 9)


@pytest.mark.parametrize("interval", [64 << 10, 100])
async def test_bit_rot_in_the_middle_is_reported_never_returned(
    tmp_path: Path, interval: int
) -> None:
    """With a large index interval recovery scans (and flags) the damage; with a small
    one the damage is before the last checkpoint and found by the read."""
    async with open_store(tmp_path, index_interval_bytes=interval) as store:
        for i in range(10):
            await store.add_entry(1, i, payload(1, i, 500))
        starts = list(store._segments[1].starts)
    log = files(tmp_path, 1)["log"]
    data = bytearray(log.read_bytes())
    data[starts[5] + RECORD_HEADER_SIZE + 100] ^= 0x08
    log.write_bytes(data)
    async with open_store(tmp_path, index_interval_bytes=interval) as store:
        assert store.last_entry_id(1) == 9  # nothing was truncated
        with pytest.raises(CorruptEntry):
            store.read_entries(1, 5, 9)
        with pytest.raises(CorruptEntry):
            await store.read_entries_async(1, 5, 5)
        assert [i for i, _ in store.read_entries(1, 0, 9)] == [0, 1, 2, 3, 4]
        assert [i for i, _ in store.read_entries(1, 6, 9)] == [6, 7, 8, 9]
        assert store.statistics().corrupt_entries_detected == 2
        await store.add_entry(1, 10, b"more")  # the segment stays writable
    async with open_store(tmp_path, index_interval_bytes=interval) as store:
        assert [i for i, _ in store.read_entries(1, 6, 10)] == [6, 7, 8, 9, 10]


@pytest.mark.parametrize("interval", [64 << 10, 100])
async def test_damaged_header_in_the_middle(tmp_path: Path, interval: int) -> None:
    async with open_store(tmp_path, index_interval_bytes=interval) as store:
        for i in range(10):
            await store.add_entry(1, i, payload(1, i, 500))
        starts = list(store._segments[1].starts)
    log = files(tmp_path, 1)["log"]
    data = bytearray(log.read_bytes())
    data[starts[5] : starts[5] + 8] = b"\xff" * 8
    data[starts[0] + 3] ^= 1  # and entry 0's header
    log.write_bytes(data)
    async with open_store(tmp_path, index_interval_bytes=interval) as store:
        assert store.last_entry_id(1) == 9
        for bad in (0, 5):
            with pytest.raises(CorruptEntry):
                store.read_entries(1, bad, bad)
        assert [i for i, _ in store.read_entries(1, 1, 9)] == [1, 2, 3, 4]
        assert store.read_entries(1, 6, 9) == [(i, payload(1, i, 500)) for i in range(6, 10)]


async def test_missing_or_damaged_index_is_rebuilt(tmp_path: Path) -> None:
    async with open_store(tmp_path, index_interval_bytes=700) as store:
        await fill(store, 1, 100)
    idx = files(tmp_path, 1)["idx"]
    original = idx.read_bytes()
    assert len(original) > 16 * 20
    idx.unlink()
    async with open_store(tmp_path, index_interval_bytes=700, dense_window=2) as store:
        check_all(store, 1, 100)
    assert idx.read_bytes() == original  # the same checkpoints, found again
    idx.write_bytes(b"garbage" * 10)
    async with open_store(tmp_path, index_interval_bytes=700, dense_window=2) as store:
        check_all(store, 1, 100)
    assert idx.read_bytes() == original
    # scribbled checkpoints in the middle: detected when used, the read still works
    damaged = bytearray(original)
    for off in range(16 + 5 * 16, 16 + 15 * 16, 7):
        damaged[off] ^= 0x5A
    idx.write_bytes(damaged)
    async with open_store(tmp_path, index_interval_bytes=700, dense_window=2) as store:
        for i in range(100):
            assert store.read_entries(1, i, i) == [(i, payload(1, i))]


async def test_empty_segment_of_a_crashed_first_add_is_removed(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 1)
    log = files(tmp_path, 1)["log"]
    log.write_bytes(log.read_bytes()[: FILE_HEADER_SIZE + 20])  # entry 0 torn
    async with open_store(tmp_path) as store:
        assert store.segments() == []
        await fill(store, 1, 3)  # the id can be written afresh
        check_all(store, 1, 3)
    assert not (tmp_path / "segments" / "stray.txt").exists()


async def test_group_commit_shares_fsyncs(tmp_path: Path) -> None:
    async with open_store(tmp_path, fsync="always") as store:

        async def writer(seg: int) -> None:
            for i in range(50):
                await store.add_entry(seg, i, payload(seg, i))

        async with trio.open_nursery() as nursery:
            for seg in range(8):
                nursery.start_soon(writer, seg)
        stats = store.statistics()
        assert stats.entries_written == 400
        # 8 writers each wait for their fsync: rounds are shared, not one per add
        assert stats.flush_rounds <= 120
        assert stats.fsyncs <= stats.flush_rounds * 8 + 2


async def test_append_waiter(tmp_path: Path) -> None:
    async with open_store(tmp_path, fsync="always") as store:
        w = store.append(1, 0, b"x")
        assert not w.done and w.error is None
        await w.wait()
        assert w.done and w.error is None
    async with open_store(tmp_path, fsync="never") as store:
        w = store.append(1, 1, b"y")
        assert w.done and w.error is None
        await w.wait()
        with pytest.raises(InvalidEntryId):
            store.append(1, 1, b"y")


@pytest.mark.parametrize("policy", ["interval", "never"])
async def test_relaxed_fsync_policies(tmp_path: Path, policy: str) -> None:
    async with open_store(tmp_path, fsync=policy, fsync_interval_ms=1) as store:
        await fill(store, 1, 50)
        if policy == "interval":
            await trio.sleep(0.1)  # many intervals
            assert store.statistics().fsyncs >= 1
        else:
            assert store.statistics().fsyncs == 0
        await store.sync()
        assert store.statistics().fsyncs >= 1
    async with open_store(tmp_path) as store:
        check_all(store, 1, 50)


async def test_delete_segment(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 20)
        await fill(store, 2, 20)
        await store.fence(2)
        usage = store.statistics().disk_usage_bytes
        await store.delete_segment(2)
        assert store.segments() == [1]
        assert not any(p.exists() for p in files(tmp_path, 2).values())
        assert store.statistics().disk_usage_bytes < usage
        with pytest.raises(SegmentNotFound):
            store.read_entries(2, 0, 0)
        await store.delete_segment(2)  # a retried delete is fine
        await store.delete_segment(99)
    async with open_store(tmp_path) as store:
        assert store.segments() == [1]


async def test_delete_while_reading_in_a_thread(tmp_path: Path) -> None:
    async with open_store(tmp_path, inline_read_bytes=0) as store:
        await fill(store, 1, 50)
        async with trio.open_nursery() as nursery:
            results: list[int] = []

            async def reader() -> None:
                got = await store.read_entries_async(1, 0, 49)
                results.append(len(got))

            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(store.delete_segment, 1)
        assert results == [50]
        assert store.segments() == []


async def test_statistics(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 10)
        store.read_entries(1, 0, 9)
        stats = store.statistics()
        assert stats.segments == 1
        assert stats.entries_written == 10 and stats.entries_read == 10
        assert stats.bytes_read == sum(len(payload(1, i)) for i in range(10))
        assert stats.bytes_written == stats.bytes_read + 10 * RECORD_HEADER_SIZE
        assert stats.fsyncs >= 10 and not stats.read_only
        on_disk = sum(p.stat().st_size for p in (tmp_path / "segments").iterdir())
        assert stats.disk_usage_bytes == on_disk


async def test_only_usable_while_running(tmp_path: Path) -> None:
    store = SegmentStore(tmp_path)
    with pytest.raises(ServiceUnavailable):
        await store.add_entry(1, 0, b"x")
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        await store.add_entry(1, 0, b"x")
        nursery.cancel_scope.cancel()
    with pytest.raises(ServiceUnavailable):
        store.read_entries(1, 0, 0)
    with pytest.raises(RuntimeError):
        await store.run()


async def test_data_dir_is_locked(tmp_path: Path) -> None:
    async with open_store(tmp_path):
        with pytest.raises(StorageError, match="in use"):
            await SegmentStore(tmp_path).run()
    async with open_store(tmp_path):  # released on exit
        pass


async def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgument):
        SegmentStore("x", fsync="sometimes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        SegmentStore("x", fsync_interval_ms=0)


async def test_write_error_turns_the_bookie_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 3)
        real = os.pwritev

        def full(fd: int, bufs: list[bytes], offset: int) -> int:
            real(fd, [bytes(b) for b in bufs][:1], offset)  # a partial record lands
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwritev", full)
        with pytest.raises(BookieReadOnly):
            await store.add_entry(1, 3, b"x" * 100)
        monkeypatch.undo()
        assert store.statistics().read_only
        with pytest.raises(BookieReadOnly):
            await store.add_entry(1, 3, b"x" * 100)
        check_all(store, 1, 3)  # reads go on
        assert store.segment_info(1).size_bytes == files(tmp_path, 1)["log"].stat().st_size
    async with open_store(tmp_path) as store:  # a restart clears the read-only state
        await fill(store, 1, 1, start=3)
        check_all(store, 1, 4)


async def test_fsync_error_fails_the_waiting_adds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 1)
        monkeypatch.setattr(
            commit_mod, "fsync_many", lambda fds, d: OSError(errno.EIO, "I/O error")
        )
        with pytest.raises(BookieReadOnly):
            await store.add_entry(1, 1, b"x")
        assert store.statistics().read_only
