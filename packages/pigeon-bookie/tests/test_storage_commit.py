"""Group commit (pigeon.bookie._storage_commit): fsyncs shared by the adds of a round,
the durability waiter, the fsync policies, a failed fsync."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import trio
from test_storage import add_fails_read_only, check_all, fill, open_store, payload

import pigeon.bookie._storage_commit as commit_mod
from pigeon.core.errors import (
    InvalidEntryId,
)


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


async def test_fsync_error_fails_the_waiting_adds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 1)
        monkeypatch.setattr(
            commit_mod, "fsync_many", lambda fds, d, drops=(): OSError(errno.EIO, "I/O error")
        )
        await add_fails_read_only(store, 1, 1)
