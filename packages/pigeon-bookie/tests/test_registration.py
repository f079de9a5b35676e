"""Registration, disk checks and GC of a running BookieServer, on trio's MockClock.

The metadata store is the in-memory one of conftest.py (no threads, no timers), the
free disk space a fake: minutes of bookie life pass in no time.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from pigeon.bookie import BookieConfig, BookieServer
from pigeon.core.paths import segment_path

GIB = 1 << 30


class _HoldClockWhileThreadsRun(trio.abc.Instrument):
    """Keeps an autojump clock still while a worker thread runs.

    The bookie deletes segment files in worker threads.  A plain autojump clock keeps
    jumping from timer to timer meanwhile (the disk check fires every virtual second), so
    a slow unlink lets hours of virtual time pass in the middle of one collection round.
    Checked after every task step: the step that starts a thread borrows a limiter token,
    the step that takes its result back returns it.
    """

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self.clock = clock

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        busy = trio.to_thread.current_default_thread_limiter().statistics().borrowed_tokens
        threshold = math.inf if busy else 0.0
        if self.clock.autojump_threshold != threshold:
            self.clock.autojump_threshold = threshold


@pytest.fixture
async def threads_hold_the_clock(autojump_clock: trio.testing.MockClock) -> AsyncIterator[None]:
    """``autojump_clock`` (which the test must request itself, for pytest-trio to run
    on it) does not jump while a worker thread runs."""
    instrument = _HoldClockWhileThreadsRun(autojump_clock)
    trio.lowlevel.add_instrument(instrument)
    yield
    trio.lowlevel.remove_instrument(instrument)


@asynccontextmanager
async def running(
    tmp_path: Path, meta: Any, free: list[int], **options: Any
) -> AsyncIterator[BookieServer]:
    config = BookieConfig(data_dir=str(tmp_path), port=0, fsync="never", **options)
    server = BookieServer(config, metadata=meta)
    server.disk_usage = lambda: (100 * GIB, free[0])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        yield server
        nursery.cancel_scope.cancel()


def registration(meta: Any, server: BookieServer) -> dict[str, Any]:
    return json.loads(meta.nodes[server.registration_path][0])  # type: ignore[no-any-return]


async def test_registration_reports_rates_over_the_last_interval(
    tmp_path: Path, autojump_clock: Any, memory_metadata: Any
) -> None:
    meta = memory_metadata
    async with running(tmp_path, meta, [50 * GIB], register_interval_s=10) as server:
        first = registration(meta, server)
        assert first["write_bytes_per_s"] == 0 and first["segments"] == 0
        assert first["free_disk_bytes"] == 50 * GIB and first["total_disk_bytes"] == 100 * GIB
        for i in range(100):
            server.store.append(1, i, b"x" * 960)  # 1000 bytes a record with its header
        await trio.sleep(10.5)
        reg = registration(meta, server)
        assert reg["write_bytes_per_s"] == 100 * 1000 / 10  # a rate, not a total
        assert reg["read_bytes_per_s"] == 0
        assert reg["segments"] == 1 and reg["disk_used_bytes"] >= 100 * 1000
        server.store.read_entries(1, 0, 99)
        await trio.sleep(10)
        reg = registration(meta, server)
        assert reg["write_bytes_per_s"] == 0  # nothing written in the last interval
        assert reg["read_bytes_per_s"] == 960 * 100 / 10
        assert meta.nodes[server.registration_path][1] == 2  # refreshed twice


async def test_read_only_is_published_at_once(
    tmp_path: Path, autojump_clock: Any, memory_metadata: Any
) -> None:
    meta = memory_metadata
    free = [50 * GIB]
    options = {"register_interval_s": 60, "disk_check_interval_s": 1, "min_free_disk_bytes": GIB}
    async with running(tmp_path, meta, free, **options) as server:
        assert not registration(meta, server)["read_only"]
        free[0] = GIB // 2
        await trio.sleep(1.5)  # one disk check, well before the next refresh
        reg = registration(meta, server)
        assert reg["read_only"] and "below the threshold" in reg["read_only_reason"]
        free[0] = 2 * GIB
        await trio.sleep(1)
        assert not registration(meta, server)["read_only"]
    # and a bookie that starts on a full disk starts read-only
    async with running(tmp_path, meta, [GIB // 2], min_free_disk_bytes=GIB) as server:
        assert registration(meta, server)["read_only"]


async def test_registers_again_after_the_session_expired(
    tmp_path: Path, autojump_clock: Any, memory_metadata: Any
) -> None:
    meta = memory_metadata
    options = {"register_interval_s": 30, "advertised_address": "bookie-1:3181"}
    async with running(tmp_path, meta, [50 * GIB], **options) as server:
        path = server.registration_path
        assert meta.nodes[path][2]  # ephemeral
        meta.expire_session()
        assert path not in meta.nodes
        await trio.sleep(0.1)  # long before the next refresh
        assert path in meta.nodes and meta.sessions == 2
        # a stale registration (a previous run's, not yet expired) is replaced
    meta.nodes[path] = (b'{"address": "old"}', 7, True)
    async with running(tmp_path, meta, [50 * GIB], **options) as server:
        assert registration(meta, server)["address"] == "bookie-1:3181"
    assert path not in meta.nodes  # unregistered on a clean stop


async def test_gc_runs_in_the_server(
    tmp_path: Path, autojump_clock: Any, threads_hold_the_clock: None, memory_metadata: Any
) -> None:
    # Deletions run in a worker thread: the clock must not jump while one is in flight
    # (else the orphan's unlink can outlast the expiry of the other segment), and every
    # "eventually" waits for a collection round that began after the threshold.
    meta = memory_metadata
    options = {"gc_interval_s": 60, "gc_grace_s": 300, "segment_expiry_s": 3600}
    async with running(tmp_path, meta, [50 * GIB], **options) as server:
        store, collector = server.store, server.collector
        await meta.create(segment_path(1), b"{}")
        for seg in (1, 2):
            await store.add_entry(seg, 0, b"x" * 1000)
        await trio.sleep(250)
        assert store.segments() == [1, 2]  # within the grace period: kept
        assert collector.statistics().rounds == 4
        await trio.sleep(60)  # past the grace period
        await collector.wait_round()
        assert store.segments() == [1]  # 2 had no metadata node
        assert collector.statistics().orphans_deleted == 1
        await trio.sleep(3600)  # past the expiry
        await collector.wait_round()
        assert store.segments() == []  # 1 expired: idle for an hour
        stats = collector.statistics()
        assert (stats.orphans_deleted, stats.expired_deleted) == (1, 1)
