"""SegmentStore (pigeon.bookie._storage): the store as a whole (round trips, restarts,
fencing, deletion, statistics, its lifecycle), and the helpers the other storage tests
share (``open_store``, ``payload``, ``files``, ``fill``, ``check_all``,
``add_fails_read_only``).

The parts of the store have their own tests: test_storage_writes, test_storage_reads,
test_storage_commit, test_storage_recovery; test_storage_gaps (ids that skip) and
test_storage_crash (kill -9, damage fuzzing) cover them together."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from pigeon.bookie._segment import FILE_HEADER_SIZE, RECORD_HEADER_SIZE
from pigeon.bookie._storage import SegmentStore
from pigeon.core.errors import (
    BookieReadOnly,
    InvalidArgument,
    SegmentFenced,
    SegmentNotFound,
    ServiceUnavailable,
)


def payload(segment_id: int, entry_id: int, size: int | None = None) -> bytes:
    rng = random.Random(segment_id * 1_000_003 + entry_id)
    return rng.randbytes(rng.randrange(0, 3000) if size is None else size)


@asynccontextmanager
async def open_store(path: Path, **kw: Any) -> AsyncIterator[SegmentStore]:
    """A running store on ``path`` (``kw``: its options, and ``dense_window``)."""
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


async def add_fails_read_only(store: SegmentStore, segment_id: int, entry_id: int) -> None:
    """An add of entry ``entry_id`` is refused with BookieReadOnly: the store is read-only."""
    with pytest.raises(BookieReadOnly):
        await store.add_entry(segment_id, entry_id, b"x" * 100)
    assert store.statistics().read_only


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


async def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgument):
        SegmentStore("x", fsync="sometimes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        SegmentStore("x", fsync_interval_ms=0)
