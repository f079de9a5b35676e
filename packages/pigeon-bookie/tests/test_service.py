"""The bookie RPC service over real loopback TCP, with the broker's BookieClient."""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import pigeon.bookie._service as service_mod
import pigeon.bookie._storage_commit as commit_mod
import pigeon.bookie._storage_reads as reads_mod
from pigeon.bookie import BookieConfig, BookieServer, SegmentStore
from pigeon.bookie._service import DiskSpacePolicy
from pigeon.bookie.testing import pipelined_adds
from pigeon.core._bookie_client import BookieClient
from pigeon.core.errors import (
    BookieReadOnly,
    CorruptEntry,
    EntryNotFound,
    InvalidArgument,
    InvalidEntryId,
    PigeonError,
    SegmentFenced,
    SegmentNotFound,
    ServiceUnavailable,
)
from pigeon.core.metadata import EmbeddedMetadataStore

TIMEOUT = 20
GIB = 1 << 30


def payload(segment_id: int, entry_id: int, size: int = 1000) -> bytes:
    return (f"{segment_id}:{entry_id}:".encode() * (size // 4 + 1))[:size]


@asynccontextmanager
async def running(
    tmp_path: Path, *, metadata: Any = None, store: Any = None, **options: Any
) -> AsyncIterator[tuple[BookieServer, BookieClient, str]]:
    options.setdefault("fsync", "always")
    options.setdefault("port", 0)
    config = BookieConfig(data_dir=str(tmp_path / "bookie"), **options)
    server = BookieServer(config, metadata=metadata, store=store)
    server.disk_usage = lambda: (100 * GIB, 50 * GIB)
    client = BookieClient(name="test")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            await nursery.start(client.run)
            try:
                yield server, client, server.advertised
            finally:
                client.close()
                nursery.cancel_scope.cancel()


async def test_pipelined_adds_reads_fence_and_delete(tmp_path: Path) -> None:
    async with running(tmp_path) as (server, client, addr):
        results = await pipelined_adds(client, addr, 1, list(range(200)), payload, lac=-1)
        assert all(err is None for err in results.values())
        # striped: this bookie holds only some ids of segment 2
        ids = [i for i in range(60) if i % 3 != 2]
        results = await pipelined_adds(client, addr, 2, ids, payload, lac=0)
        assert all(err is None for err in results.values())
        got = await client.read_entries(addr, 1, 0, 199)
        assert [(i, bytes(d)) for i, d in got] == [(i, payload(1, i)) for i in range(200)]
        got = await client.read_entries(addr, 2, 0, 100)
        assert [i for i, _ in got] == ids  # the response lists the ids it carries
        assert all(bytes(d) == payload(2, i) for i, d in got)
        got = await client.read_entries(addr, 1, 10, 199, max_count=5)
        assert [i for i, _ in got] == [10, 11, 12, 13, 14]
        state = await client.read_lac(addr, 2)
        assert state["last_entry_id"] == ids[-1] and state["lac"] == 0
        info = await client.segment_info(addr, 1)
        assert info["last_entry_id"] == 199 and not info["fenced"]
        state = await client.fence(addr, 1)
        assert state["fenced"] and state["last_entry_id"] == 199
        with pytest.raises(SegmentFenced):
            await client.add_entry(addr, 1, 200, 199, b"late")
        await client.delete_segment(addr, 1)
        with pytest.raises(SegmentNotFound):
            await client.read_entries(addr, 1, 0, 0)
        assert server.store.segments() == [2]


async def test_every_bad_request_gets_a_typed_error(tmp_path: Path) -> None:
    async with running(tmp_path) as (_server, client, addr):
        await client.add_entry(addr, 1, 0, -1, b"zero")
        await client.add_entry(addr, 1, 5, 0, b"five")  # a gap: fine
        bad: list[tuple[Any, type[PigeonError]]] = [
            (lambda: client.read_entries(addr, 9, 0, 0), SegmentNotFound),
            (lambda: client.read_lac(addr, 9), SegmentNotFound),
            (lambda: client.segment_info(addr, 9), SegmentNotFound),
            (lambda: client.add_entry(addr, 1, 5, 0, b"again"), InvalidEntryId),
            (lambda: client.add_entry(addr, 1, 3, 0, b"below"), InvalidEntryId),
            (lambda: client.add_entry(addr, 1, -1, 0, b"negative"), InvalidEntryId),
            (lambda: client.add_entry(addr, -1, 0, 0, b"bad segment"), InvalidArgument),
            (lambda: client.read_entries(addr, 1, 6, 10), EntryNotFound),  # past the last
            (lambda: client.read_entries(addr, 1, 2, 4), EntryNotFound),  # never stored here
            (lambda: client.read_entries(addr, 1, 4, 2), InvalidArgument),
        ]
        for call, error in bad:
            with pytest.raises(error) as info:
                await call()
            assert not info.value.retriable
        # damage entry 5 on disk under the running store: reported, never returned
        log = tmp_path / "bookie" / "segments" / f"{1:016x}.log"
        data = bytearray(log.read_bytes())
        data[-1] ^= 0xFF
        log.write_bytes(data)
        with pytest.raises(CorruptEntry):
            await client.read_entries(addr, 1, 5, 5)
        assert [i for i, _ in await client.read_entries(addr, 1, 0, 10)] == [0]
        # the same connection is still in service
        conn = await client.connection(addr)
        await client.add_entry(addr, 1, 6, 5, b"six")
        assert await client.connection(addr) is conn and not conn.closed
        assert bytes((await client.read_entries(addr, 1, 6, 6))[0][1]) == b"six"


async def test_large_reads_run_in_a_worker_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    where: list[bool] = []
    real = reads_mod.collect_entries

    def spy(*args: Any, **kwargs: Any) -> Any:
        where.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(reads_mod, "collect_entries", spy)
    store = SegmentStore(tmp_path / "bookie", inline_read_bytes=64 << 10)
    async with running(tmp_path, store=store, read_max_bytes=3 << 20) as (_, client, addr):
        await pipelined_adds(client, addr, 1, list(range(40)), payload, lac=-1)
        big = [bytes([i]) * 100_000 for i in range(40)]
        for i, data in enumerate(big):
            await client.add_entry(addr, 2, i, i - 1, data)
        where.clear()
        got = await client.read_entries(addr, 2, 0, 39, max_bytes=64 << 20)
        assert where == [False]  # ~3 MiB: read off the event loop
        # capped by read_max_bytes (the response must fit in a frame), at least one entry
        assert 25 <= len(got) <= 31
        assert [bytes(d) for _, d in got] == big[: len(got)]
        where.clear()
        await client.read_entries(addr, 1, 3, 3)
        assert where == [True]  # a small read stays in the trio thread


async def pipelined_reads(
    client: BookieClient, address: str, segment_id: int, n: int, last: int
) -> list[Any]:
    """``n`` reads of the whole segment sent at once; each result or error."""
    conn = await client.connection(address)
    results: list[Any] = []
    done = trio.Event()

    def callback(result: Any, error: BaseException | None) -> None:
        results.append(error if error is not None else result)
        if len(results) == n:
            done.set()

    for _ in range(n):
        conn.request_nowait(
            "readEntries",
            {"segmentId": segment_id, "firstEntryId": 0, "lastEntryId": last},
            callback,
            expect="readResponse",
            extract=lambda body, data: [(e.entryId, e.size) for e in body.entries],
        )
    await done.wait()
    return results


async def test_pipelined_reads_are_bounded_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running(tmp_path) as (_, client, addr):
        for i in range(8):
            await client.add_entry(addr, 1, i, i - 1, bytes([i]) * 200_000)
        # 100 reads of 1.6 MiB each at once: read a few at a time, as the client drains
        results = await pipelined_reads(client, addr, 1, 100, 7)
        assert results == [[(i, 200_000) for i in range(8)]] * 100
        # past the queue limit, reads are refused with a retriable error
        monkeypatch.setattr(service_mod, "MAX_QUEUED_READS", 5)
        results = await pipelined_reads(client, addr, 1, 40, 7)
        refused = [r for r in results if isinstance(r, ServiceUnavailable)]
        assert refused and all(r.retriable for r in refused)
        assert len(results) - len(refused) >= 5
        assert await client.read_entries(addr, 1, 7, 7)  # and the connection goes on


async def test_a_full_disk_makes_adds_fail_retriably_until_space_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory_metadata: Any
) -> None:
    meta = memory_metadata
    async with running(tmp_path, metadata=meta) as (server, client, addr):
        await client.add_entry(addr, 1, 0, -1, b"a")
        real = os.pwritev

        def full(fd: int, bufs: list[bytes], offset: int) -> int:
            real(fd, [bytes(b) for b in bufs][:1], offset)  # a partial record lands
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwritev", full)
        with pytest.raises(BookieReadOnly) as info:
            await client.add_entry(addr, 1, 1, 0, b"b")
        assert info.value.retriable
        await server.publish()
        reg = json.loads(meta.nodes[server.registration_path][0])
        assert reg["read_only"] and "No space left" in reg["read_only_reason"]
        monkeypatch.undo()
        with pytest.raises(BookieReadOnly):  # still read-only: nobody looked at the disk
            await client.add_entry(addr, 1, 1, 0, b"b")
        server.check_disk()  # 50 GiB free: space is back
        await client.add_entry(addr, 1, 1, 0, b"b")
        assert [bytes(d) for _, d in await client.read_entries(addr, 1, 0, 9)] == [b"a", b"b"]
        await server.publish()
        assert not json.loads(meta.nodes[server.registration_path][0])["read_only"]


async def test_an_io_error_keeps_the_bookie_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running(tmp_path) as (server, client, addr):
        await client.add_entry(addr, 1, 0, -1, b"a")
        monkeypatch.setattr(
            commit_mod, "fsync_many", lambda fds, d, drops=(): OSError(errno.EIO, "I/O error")
        )
        with pytest.raises(BookieReadOnly):
            await client.add_entry(addr, 1, 1, 0, b"b")
        monkeypatch.undo()
        server.check_disk()
        assert server.store.read_only is not None  # until a restart
        with pytest.raises(BookieReadOnly):
            await client.add_entry(addr, 1, 2, 0, b"c")
        assert bytes((await client.read_entries(addr, 1, 0, 0))[0][1]) == b"a"  # reads go on


async def test_low_free_space_turns_read_only_and_back(
    tmp_path: Path, memory_metadata: Any
) -> None:
    meta = memory_metadata
    mib = 1 << 20
    async with running(tmp_path, metadata=meta, min_free_disk_bytes=100 * mib) as (
        server,
        client,
        addr,
    ):
        free = [500 * mib]
        server.disk_usage = lambda: (GIB, free[0])
        server.check_disk()
        await client.add_entry(addr, 1, 0, -1, b"a")
        free[0] = 99 * mib
        server.check_disk()
        with pytest.raises(BookieReadOnly):
            await client.add_entry(addr, 1, 1, 0, b"b")
        await server.publish()
        reg = json.loads(meta.nodes[server.registration_path][0])
        assert reg["read_only"] and reg["free_disk_bytes"] == 99 * mib
        free[0] = 101 * mib  # above the threshold, not above its margin: no flapping
        server.check_disk()
        assert server.store.read_only is not None
        free[0] = 120 * mib
        server.check_disk()
        await client.add_entry(addr, 1, 1, 0, b"b")


def test_disk_space_policy() -> None:
    p = DiskSpacePolicy(1000, 10.0)
    assert p.threshold(5000) == 1000 and p.threshold(50_000) == 5000
    assert p.low(50_000, 4999) and not p.low(50_000, 5000)
    assert not p.recovered(50_000, 5000 + 1024) and p.recovered(50_000, 5000 + (1 << 20))
    off = DiskSpacePolicy(0)
    assert not off.low(100, 0)


async def test_registration_in_a_real_metadata_store(tmp_path: Path) -> None:
    meta = EmbeddedMetadataStore(tmp_path / "meta", session_timeout=5)
    async with trio.open_nursery() as outer:
        await outer.start(meta.run)
        async with running(tmp_path, metadata=meta, register_interval_s=0.2) as (
            _server,
            client,
            addr,
        ):
            await client.add_entry(addr, 1, 0, -1, b"x" * 1000)
            path = f"/pigeon/bookies/available/{addr}"
            stat = await meta.get(path)
            assert stat is not None and stat.ephemeral
            reg = json.loads(stat.value)
            assert reg["address"] == addr and reg["read_only"] is False
            for key in ("free_disk_bytes", "disk_used_bytes", "segments"):
                assert isinstance(reg[key], int)
            for key in ("write_bytes_per_s", "read_bytes_per_s"):
                assert isinstance(reg[key], float | int)
            # the session expires: the node goes, and the bookie registers again
            await meta.expire_session()
            assert await meta.get(path) is None
            async with meta.watch(path) as events:
                if await meta.get(path) is None:
                    with trio.fail_after(10):
                        await events.__anext__()
            stat = await meta.get(path)
            assert stat is not None and json.loads(stat.value)["segments"] == 1
        # a clean stop unregisters at once
        assert await meta.get(path) is None
        outer.cancel_scope.cancel()


def test_config_validation() -> None:
    from pigeon.core import load_config
    from pigeon.core.errors import ConfigError

    config = load_config(
        BookieConfig,
        env={},
        overrides={"gc_grace_s": "600", "segment_expiry_s": 86400, "min_free_disk_percent": 5},
    )
    assert config.gc_grace_s == 600 and config.segment_expiry_s == 86400
    for bad in (
        {"gc_interval_s": 0},
        {"segment_expiry_s": -1},
        {"min_free_disk_percent": 100},
        {"register_interval_s": 0},
        {"page_cache_window_bytes": -2},
    ):
        with pytest.raises(ConfigError):
            load_config(BookieConfig, env={}, overrides=bad)


def test_page_cache_options_reach_both_storages(tmp_path: Path) -> None:
    from pigeon.bookie._service import build_ledger_storage
    from pigeon.core import load_config
    from pigeon.core._plugins import PluginManager

    plugins = PluginManager()
    overrides = {
        "data_dir": str(tmp_path),
        "page_cache_window_bytes": "-1",
        "journal_remove_pages_from_cache": "false",
    }
    for name in ("segment-files", "journal"):
        config = load_config(BookieConfig, env={}, overrides={**overrides, "ledger_storage": name})
        store = build_ledger_storage(config, plugins)
        window = store._logs._cache_window if name == "journal" else store._cache_window
        assert window == -1
        if name == "journal":
            assert store._remove_journal_pages is False
    default = load_config(BookieConfig, env={}, overrides={"data_dir": str(tmp_path)})
    assert build_ledger_storage(default, plugins)._cache_window == 64 << 20


async def test_a_read_response_carries_the_read_entries_unjoined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running(tmp_path) as (server, client, addr):
        for i in range(3):
            await client.add_entry(addr, 1, i, i - 1, payload(1, i))
        read_entries = server.store.read_entries_async
        read: list[Any] = []
        responded: list[Any] = []

        async def recording_read(*args: Any, **kwargs: Any) -> Any:
            read.extend(await read_entries(*args, **kwargs))
            return read

        def recording_respond(conn: Any, request_id: int, kind: str, *args: Any) -> None:
            responded.append(args)
            respond(conn, request_id, kind, *args)

        respond = service_mod.Connection.respond
        monkeypatch.setattr(server.store, "read_entries_async", recording_read)
        monkeypatch.setattr(service_mod.Connection, "respond", recording_respond)
        got = await client.read_entries(addr, 1, 0, 2)
    assert [bytes(d) for _, d in got] == [payload(1, i) for i in range(3)]
    ((_fields, sent),) = responded
    assert len(sent) == 3 and all(s is d for s, (_, d) in zip(sent, read, strict=True))
