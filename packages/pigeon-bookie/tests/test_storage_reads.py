"""Range reads (pigeon.bookie._storage_reads): limits, errors, reads through the sparse
index."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_storage import check_all, fill, open_store, payload

from pigeon.core.errors import (
    EntryNotFound,
    InvalidArgument,
    SegmentNotFound,
)


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
