"""Garbage collection: orphaned segments (metadata gone) and expired ones.

Time runs on trio's MockClock (``autojump_clock``): hours pass in no time.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import test_storage
import trio

from pigeon.bookie import SegmentCollector, SegmentStore
from pigeon.core.errors import MetadataError
from pigeon.core.paths import SEGMENTS_PATH, segment_path

#: a running store on a data directory (no fsync: these tests stop it cleanly)
open_store = functools.partial(test_storage.open_store, fsync="never")


def files_bytes(path: Path) -> int:
    """Size of the segment files, without asking the store (nor statvfs)."""
    return sum(p.stat().st_size for p in (path / "segments").iterdir())


async def fill(store: SegmentStore, segment_id: int, n: int = 20, size: int = 10_000) -> None:
    for i in range(n):
        await store.add_entry(segment_id, i, bytes([segment_id]) * size)


async def test_orphans_are_collected_after_the_grace_period(
    tmp_path: Path, autojump_clock: Any, memory_metadata: Any
) -> None:
    meta = memory_metadata
    async with open_store(tmp_path) as store:
        await meta.create(segment_path(1), b"{}")  # segment 1 is known; 2 and 3 are not
        for seg in (1, 2, 3):
            await fill(store, seg)
        gc = SegmentCollector(store, meta, grace_s=300, interval_s=60)
        before_usage, before_files = store.statistics().disk_usage_bytes, files_bytes(tmp_path)
        assert await gc.collect() == []  # all within the grace period
        await trio.sleep(250)
        await store.add_entry(3, 20, b"late add")  # resets segment 3's grace period
        await trio.sleep(60)
        assert await gc.collect() == [(2, "orphan")]
        assert store.segments() == [1, 3]
        assert not (tmp_path / "segments" / f"{2:016x}.log").exists()
        # disk space comes back: by the store's account and by the files themselves
        assert store.statistics().disk_usage_bytes < before_usage - 20 * 10_000
        assert files_bytes(tmp_path) < before_files - 20 * 10_000
        assert gc.statistics().bytes_freed >= 20 * 10_000
        await trio.sleep(300)
        assert await gc.collect() == [(3, "orphan")]
        assert store.segments() == [1]
        assert gc.statistics().orphans_deleted == 2


async def test_no_collection_without_the_segments_node_or_on_metadata_errors(
    tmp_path: Path, autojump_clock: Any, memory_metadata: Any
) -> None:
    meta = memory_metadata
    async with open_store(tmp_path) as store:
        await fill(store, 1)
        gc = SegmentCollector(store, meta, grace_s=10)
        await trio.sleep(20)
        # an empty (or wrong) metadata store: nothing is taken as an orphan
        assert SEGMENTS_PATH not in meta.nodes
        assert await gc.collect() == []
        await meta.create(segment_path(99), b"{}")  # the segments node exists now
        meta.fail = MetadataError("metadata store unreachable")
        assert await gc.collect() == []  # an error is never taken for "missing"
        assert gc.statistics().rounds_skipped == 2
        meta.fail = None
        assert await gc.collect() == [(1, "orphan")]


async def test_without_metadata_only_expiry_applies(tmp_path: Path, autojump_clock: Any) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1)
        await fill(store, 2)
        await store.fence(2)
        gc = SegmentCollector(store, None, grace_s=1, expiry_s=3600)
        await trio.sleep(1800)
        await store.add_entry(1, 20, b"still written")
        await trio.sleep(1800)
        # 2 (fenced, idle an hour) expires; 1 was added to half an hour ago
        assert await gc.collect() == [(2, "expired")]
        await trio.sleep(1800)
        assert await gc.collect() == [(1, "expired")]
        assert store.segments() == [] and files_bytes(tmp_path) == 0
        assert gc.statistics().expired_deleted == 2


async def test_expiry_counts_from_the_files_mtime_after_a_restart(
    tmp_path: Path, autojump_clock: Any
) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1)
        await fill(store, 2)
    old = time.time() - 7200
    for p in (tmp_path / "segments").glob(f"{1:016x}.*"):
        os.utime(p, (old, old))  # segment 1 was last written two hours ago
    async with open_store(tmp_path) as store:
        assert store.idle_time(1) >= 7199 and store.idle_time(2) < 60
        gc = SegmentCollector(store, None, expiry_s=3600)
        assert await gc.collect() == [(1, "expired")]
        assert store.segments() == [2]


async def test_collector_runs_every_interval(
    tmp_path: Path, autojump_clock: Any, memory_metadata: Any
) -> None:
    meta = memory_metadata
    await meta.create(SEGMENTS_PATH, b"")
    async with open_store(tmp_path) as store:
        await fill(store, 5)
        gc = SegmentCollector(store, meta, grace_s=100, interval_s=30)
        async with trio.open_nursery() as nursery:
            await nursery.start(gc.run)
            await trio.sleep(95)
            assert store.segments() == [5]  # rounds at 30, 60, 90: within the grace
            await trio.sleep(30)
            assert store.segments() == []  # the round at 120 took it
            nursery.cancel_scope.cancel()
