"""The ledger storage contract suite: what every bookie storage backend must do.

Subclass :class:`LedgerStorageContract` in a test module of the backend and provide four
fixtures::

    import pytest
    from pigeon.core.testing import LedgerStorageContract

    class TestMyStorage(LedgerStorageContract):
        @pytest.fixture
        def storage_name(self):
            return "my-storage"            # the name its plugin registers

        @pytest.fixture
        def make_storage(self):
            # (path, **options) -> a LedgerStorage on ``path``, not running yet;
            # options: fsync="always"|"interval"|"never"
            return lambda path, **options: MyStorage(path, **options)

        @pytest.fixture
        def tear_tail(self):
            # (path): the stopped store's files as a crash in the middle of writing one
            # more entry leaves them: a partial record after the last one of every
            # segment (or of the journal), never acknowledged
            return my_tear_tail

        @pytest.fixture
        def corrupt_entry(self):
            # (path, segment_id, entry_id): flip bytes of that entry's stored payload
            # on disk, as a bad sector would (the store is stopped)
            return my_corrupt_entry

The ``kill -9`` test runs the backend in a child process, built the way a bookie builds
it: ``PluginManager().ledger_storages.get(storage_name)(BookieConfig(**options))`` with
the options of the ``storage_config`` fixture (``data_dir`` and ``fsync="always"`` by
default; override it when the backend needs more keys).  That test, and
``test_registered_factory_builds_a_storage``, need ``pigeon-bookie`` (its
:class:`~pigeon.bookie.BookieConfig`).

The suite checks the contract stated in :mod:`pigeon.core.storage`: appends and range
reads (skipped ids left out, ``max_bytes``/``max_count``, memoryview payloads, batches),
growing entry ids, the LAC, fencing and recovery adds, restarts under every fsync policy,
torn tails, damaged entries (never returned; repaired by a recovery add), acknowledged
entries surviving ``kill -9``, deletion, ``idle_time`` on the trio clock, statistics and
the read-only state.  Every test is bounded in time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from pigeon.core._plugins import PluginManager
from pigeon.core.errors import (
    BookieReadOnly,
    CorruptEntry,
    EntryNotFound,
    InvalidArgument,
    InvalidEntryId,
    SegmentFenced,
    SegmentNotFound,
    ServiceUnavailable,
)
from pigeon.core.storage import (
    AppendWaiter,
    Buffer,
    LedgerStorage,
    SegmentInfo,
    StoreStatistics,
)

__all__ = ["LedgerStorageContract", "StorageFactory", "entry_payload"]

#: ``make_storage(path, **options)``: a storage on ``path``, not running yet
StorageFactory = Callable[..., LedgerStorage]

#: real seconds any one step of a test may take (trio clock; tests on a MockClock do
#: not sleep)
TIMEOUT = 60.0


def entry_payload(segment_id: int, entry_id: int, size: int | None = None) -> bytes:
    """The bytes the suite stores as entry ``entry_id`` of ``segment_id`` (seeded: the
    same in the kill -9 child and in the test)."""
    rng = random.Random(segment_id * 1_000_003 + entry_id)
    if size is None:
        size = rng.randrange(0, 100_000) if entry_id % 13 == 5 else rng.randrange(0, 2000)
    return rng.randbytes(size)


@contextlib.asynccontextmanager
async def _running(
    make_storage: StorageFactory, path: Path, **options: Any
) -> AsyncIterator[LedgerStorage]:
    """A storage on ``path`` running in a nursery of its own; stopped on exit (its
    shutdown makes everything durable)."""
    store = make_storage(path, **options)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(TIMEOUT):
            await nursery.start(store.run)
        yield store
        nursery.cancel_scope.cancel()


async def _fill(store: LedgerStorage, segment_id: int, ids: range | list[int]) -> None:
    for eid in ids:
        await store.add_entry(segment_id, eid, entry_payload(segment_id, eid), lac=eid - 1)


def _read_all(store: LedgerStorage, segment_id: int, first: int, last: int) -> dict[int, bytes]:
    """Every stored entry of ``first..last``, read in as many range reads as it takes."""
    out: dict[int, bytes] = {}
    while first <= last:
        got = store.read_entries(segment_id, first, last)
        assert got, f"segment {segment_id}: nothing read from {first}"
        assert [eid for eid, _ in got] == sorted({eid for eid, _ in got})
        assert got[0][0] >= first and got[-1][0] <= last
        out.update(got)
        first = got[-1][0] + 1
        # skip ids the segment does not hold (EntryNotFound for a skipped first id)
        while first <= last:
            try:
                store.read_entries(segment_id, first, first)
                break
            except EntryNotFound:
                first += 1
    return out


def _check(store: LedgerStorage, segment_id: int, ids: range | list[int]) -> None:
    """Exactly ``ids`` are stored in the segment, each with its payload."""
    ids = list(ids)
    assert store.last_entry_id(segment_id) == ids[-1]
    got = _read_all(store, segment_id, ids[0], ids[-1])
    assert sorted(got) == ids
    for eid in ids:
        assert got[eid] == entry_payload(segment_id, eid), f"entry {eid} differs"


# The kill -9 child: appends with fsync=always through three paths (add_entry, append +
# waiter, add_entries batches) and prints "segment entry lac" for every acknowledged entry.
_CHILD = """
import json, random, sys, trio
from pigeon.bookie import BookieConfig
from pigeon.core import PluginManager
from pigeon.core.errors import SegmentNotFound
from pigeon.core.testing._storage_suite import entry_payload

name, options = sys.argv[1], json.loads(sys.argv[2])

def ack(seg, first, n=1, lac=None):
    lac = first - 1 if lac is None else lac
    sys.stdout.write("".join(f"{seg} {e} {lac}\\n" for e in range(first, first + n)))
    sys.stdout.flush()

async def main():
    store = PluginManager().ledger_storages.get(name)(BookieConfig(**options))
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)

        def next_id(seg):
            try:
                return store.last_entry_id(seg) + 1
            except SegmentNotFound:
                return 0

        async def one_by_one(seg):
            eid = next_id(seg)
            while True:
                await store.add_entry(seg, eid, entry_payload(seg, eid), lac=eid - 1)
                ack(seg, eid)
                eid += 1

        async def pipelined(seg):
            eid = next_id(seg)
            limit = trio.Semaphore(16)
            async with trio.open_nursery() as acks:
                while True:
                    await limit.acquire()
                    waiter = store.append(seg, eid, entry_payload(seg, eid), lac=eid - 1)

                    async def wait(waiter=waiter, eid=eid):
                        await waiter.wait()
                        ack(seg, eid)
                        limit.release()

                    acks.start_soon(wait)
                    eid += 1

        async def batches(seg):
            eid = next_id(seg)
            while True:
                n = 1 + eid % 7
                await store.add_entries(
                    seg, eid, [entry_payload(seg, e) for e in range(eid, eid + n)], lac=eid - 1
                )
                ack(seg, eid, n, lac=eid - 1)
                eid += n

        nursery.start_soon(one_by_one, 1)
        nursery.start_soon(pipelined, 2)
        nursery.start_soon(batches, 3)
        nursery.start_soon(one_by_one, 4)

trio.run(main)
"""


class LedgerStorageContract:
    """Contract tests for a :class:`pigeon.core.storage.LedgerStorage`; see the module
    documentation for the fixtures a subclass provides."""

    #: a deleted segment's disk space is free when delete_segment returns (False for a
    #: backend whose files hold many segments and free space by compaction later, as
    #: BookKeeper's entry logs do: it tests its compaction itself)
    reclaims_on_delete = True

    # -- fixtures a backend provides -----------------------------------------------------

    @pytest.fixture
    def storage_name(self) -> str:
        raise NotImplementedError("a LedgerStorageContract subclass must provide `storage_name`")

    @pytest.fixture
    def make_storage(self) -> StorageFactory:
        raise NotImplementedError("a LedgerStorageContract subclass must provide `make_storage`")

    @pytest.fixture
    def tear_tail(self) -> Callable[[Path], None]:
        raise NotImplementedError("a LedgerStorageContract subclass must provide `tear_tail`")

    @pytest.fixture
    def corrupt_entry(self) -> Callable[[Path, int, int], None]:
        raise NotImplementedError("a LedgerStorageContract subclass must provide `corrupt_entry`")

    @pytest.fixture
    def storage_config(self) -> Callable[[Path], dict[str, Any]]:
        """``BookieConfig`` keys of a bookie using the backend on ``path`` with
        ``fsync="always"`` (the kill -9 child builds its storage from them)."""
        return lambda path: {"data_dir": str(path), "fsync": "always"}

    # -- registration ----------------------------------------------------------------------

    def test_registered_factory_builds_a_storage(
        self,
        storage_name: str,
        storage_config: Callable[[Path], dict[str, Any]],
        tmp_path: Path,
    ) -> None:
        bookie = pytest.importorskip("pigeon.bookie")
        registry = PluginManager().ledger_storages
        assert storage_name in registry
        store = registry.get(storage_name)(bookie.BookieConfig(**storage_config(tmp_path)))
        assert isinstance(store, LedgerStorage)

    async def test_calls_outside_run_are_service_unavailable(
        self, make_storage: StorageFactory, tmp_path: Path
    ) -> None:
        store = make_storage(tmp_path)
        assert isinstance(store, LedgerStorage)
        with pytest.raises(ServiceUnavailable):
            store.append(1, 0, b"x")
        async with _running(make_storage, tmp_path) as running:
            await running.add_entry(1, 0, b"x")
        with pytest.raises(ServiceUnavailable):
            running.read_entries(1, 0, 0)

    # -- appends and reads -----------------------------------------------------------------

    async def test_append_and_read_round_trip(
        self, make_storage: StorageFactory, tmp_path: Path
    ) -> None:
        sizes = [0, 1, 100, 5000, 300_000, 1 << 20, 7]
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                for eid, size in enumerate(sizes):
                    await store.add_entry(3, eid, entry_payload(3, eid, size), lac=eid - 1)
                assert store.last_entry_id(3) == len(sizes) - 1
                for eid, size in enumerate(sizes):
                    got = store.read_entries(3, eid, eid)
                    assert got == [(eid, entry_payload(3, eid, size))]
                    assert type(got[0][1]) is bytes
                expected = [(eid, entry_payload(3, eid, size)) for eid, size in enumerate(sizes)]
                # large reads may come back in parts (max_bytes): ask again from there
                out: list[tuple[int, bytes]] = []
                while len(out) < len(sizes):
                    got = store.read_entries(3, len(out), len(sizes) + 10)
                    assert got
                    out += got
                assert out == expected
                out = []
                while len(out) < len(sizes):
                    got = await store.read_entries_async(3, len(out), len(sizes) + 10)
                    assert got
                    out += got
                assert out == expected
                info = store.segment_info(3)
                assert isinstance(info, SegmentInfo)
                assert (info.segment_id, info.last_entry_id, info.fenced) == (3, 6, False)
                assert info.size_bytes >= sum(sizes)

    async def test_skipped_ids_are_left_out(
        self, make_storage: StorageFactory, tmp_path: Path
    ) -> None:
        ids = [0, 1, 5, 6, 9, 1000]
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                await _fill(store, 8, ids)
                got = store.read_entries(8, 0, 1000)
                assert [eid for eid, _ in got] == ids
                assert all(data == entry_payload(8, eid) for eid, data in got)
                assert [eid for eid, _ in store.read_entries(8, 5, 999)] == [5, 6, 9]
                assert [eid for eid, _ in await store.read_entries_async(8, 1, 7)] == [1, 5, 6]
                for missing in (2, 4, 7, 999):
                    with pytest.raises(EntryNotFound):
                        store.read_entries(8, missing, missing)
                with pytest.raises(EntryNotFound):
                    store.read_entries(8, 1001, 2000)  # beyond the last entry
                with pytest.raises(SegmentNotFound):
                    store.read_entries(9, 0, 0)
                with pytest.raises(InvalidArgument):
                    store.read_entries(8, 5, 4)
                assert store.last_entry_id(8) == 1000

    async def test_read_limits(self, make_storage: StorageFactory, tmp_path: Path) -> None:
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                for eid in range(10):
                    await store.add_entry(4, eid, entry_payload(4, eid, 1000))
                assert [e for e, _ in store.read_entries(4, 2, 9, max_count=3)] == [2, 3, 4]
                # 2 payloads of 1000 bytes fit in 2500, a third would not
                assert [e for e, _ in store.read_entries(4, 0, 9, max_bytes=2500)] == [0, 1]
                # one entry at least, whatever max_bytes says
                assert [e for e, _ in store.read_entries(4, 5, 9, max_bytes=10)] == [5]
                got = await store.read_entries_async(4, 0, 9, max_count=4, max_bytes=1 << 20)
                assert [e for e, _ in got] == [0, 1, 2, 3]

    async def test_memoryview_and_bytearray_payloads(
        self, make_storage: StorageFactory, tmp_path: Path
    ) -> None:
        data = entry_payload(5, 0, 10_000)
        frame = bytearray(b"\xaa" * 13 + data + b"\x55" * 7)
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                await store.add_entry(5, 0, memoryview(frame)[13 : 13 + len(data)])
                await store.add_entry(5, 1, bytearray(data[:100]))
                waiter = store.append(5, 2, memoryview(frame)[13:113])
                await waiter.wait()
                # once acknowledged, the store no longer needs the caller's buffer
                frame[:] = bytes(len(frame))
                got = store.read_entries(5, 0, 2)
                assert got == [(0, data), (1, data[:100]), (2, data[:100])]
                assert all(type(p) is bytes for _, p in got)
                with pytest.raises(InvalidArgument):
                    store.append(5, 3, "not bytes")  # type: ignore[arg-type]

    async def test_add_entries_batches(self, make_storage: StorageFactory, tmp_path: Path) -> None:
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                batch = [entry_payload(6, eid) for eid in range(5)]
                views: list[Buffer] = [
                    batch[0],
                    memoryview(batch[1]),
                    bytearray(batch[2]),
                    batch[3],
                    batch[4],
                ]
                await store.add_entries(6, 0, views, lac=-1)
                await store.add_entries(6, 10, [entry_payload(6, e) for e in (10, 11)], lac=4)
                await store.add_entries(6, 12, [])  # nothing to do
                _check(store, 6, [0, 1, 2, 3, 4, 10, 11])
                assert store.read_lac(6) == 4
                with pytest.raises(InvalidEntryId):
                    await store.add_entries(6, 11, [b"again", b"and again"])
                _check(store, 6, [0, 1, 2, 3, 4, 10, 11])

    async def test_entry_ids_must_grow(self, make_storage: StorageFactory, tmp_path: Path) -> None:
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                await _fill(store, 2, range(3))
                for eid in (2, 1, 0, -1):
                    with pytest.raises(InvalidEntryId):
                        store.append(2, eid, b"x")  # refused at once, not on wait
                    with pytest.raises(InvalidEntryId):
                        await store.add_entry(2, eid, b"x")
                await _fill(store, 2, [3, 7])
                with pytest.raises(InvalidEntryId):
                    await store.add_entry(2, 5, b"below the last one")
                _check(store, 2, [0, 1, 2, 3, 7])
                with pytest.raises(InvalidArgument):
                    store.append(-1, 0, b"x")

    async def test_append_waiter(self, make_storage: StorageFactory, tmp_path: Path) -> None:
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                called: list[int] = []
                waiters = []
                for eid in range(20):
                    waiter = store.append(7, eid, entry_payload(7, eid), lac=eid - 1)
                    assert isinstance(waiter, AppendWaiter)
                    waiter.add_done_callback(functools.partial(called.append, eid))
                    waiters.append(waiter)
                for waiter in waiters:
                    await waiter.wait()
                    assert waiter.done and waiter.error is None
                assert sorted(called) == list(range(20))
                late: list[str] = []
                waiters[0].add_done_callback(lambda: late.append("at once"))
                assert late == ["at once"]
                _check(store, 7, range(20))

    # -- LAC and fencing ---------------------------------------------------------------------

    async def test_lac_highest_kept_and_survives_restart(
        self, make_storage: StorageFactory, tmp_path: Path
    ) -> None:
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                await store.add_entry(1, 0, b"a")
                assert store.read_lac(1) == -1
                await store.add_entry(1, 1, b"b", lac=0)
                await store.add_entry(1, 2, b"c", lac=1)
                await store.add_entry(1, 3, b"d", lac=0)  # a late, lower lac
                assert store.read_lac(1) == 1
                assert store.segment_info(1).lac == 1
                await store.add_entries(2, 0, [b"x", b"y"], lac=7)
                assert store.read_lac(2) == 7
        async with _running(make_storage, tmp_path) as store:
            assert store.read_lac(1) == 1
            assert store.read_lac(2) == 7
            with pytest.raises(SegmentNotFound):
                store.read_lac(3)

    async def test_fence(self, make_storage: StorageFactory, tmp_path: Path) -> None:
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                await _fill(store, 9, range(5))
                assert await store.fence(9) == 4
                assert store.segment_info(9).fenced
                with pytest.raises(SegmentFenced):
                    store.append(9, 5, b"x")
                with pytest.raises(SegmentFenced):
                    await store.add_entry(9, 5, b"x")
                with pytest.raises(SegmentFenced):
                    await store.add_entries(9, 5, [b"x"])
                # a recovery add goes through the fence ...
                await store.add_entry(9, 5, entry_payload(9, 5), lac=4, recovery=True)
                # ... is idempotent for identical bytes ...
                await store.add_entry(9, 2, entry_payload(9, 2), recovery=True)
                await store.add_entry(9, 5, memoryview(entry_payload(9, 5)), recovery=True)
                # ... and refused for other bytes
                with pytest.raises(InvalidEntryId):
                    await store.add_entry(9, 2, b"other bytes", recovery=True)
                with pytest.raises(InvalidEntryId):
                    store.append(9, 5, entry_payload(9, 5) + b"!", recovery=True)
                _check(store, 9, range(6))
                assert await store.fence(9) == 5  # fencing again is harmless
                assert store.read_lac(9) == 4

    async def test_fence_unknown_segment_creates_it_fenced_and_empty(
        self, make_storage: StorageFactory, tmp_path: Path
    ) -> None:
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                assert await store.fence(77) == -1
                assert 77 in store.segments()
                assert store.last_entry_id(77) == -1
                info = store.segment_info(77)
                assert info.fenced and info.last_entry_id == -1
                with pytest.raises(SegmentFenced):
                    await store.add_entry(77, 0, b"a late first add")
                with pytest.raises(EntryNotFound):
                    store.read_entries(77, 0, 0)
        async with _running(make_storage, tmp_path) as store:
            assert store.segments() == [77]
            assert store.segment_info(77).fenced
            with pytest.raises(SegmentFenced):
                await store.add_entry(77, 0, b"a late first add")

    async def test_fence_survives_restart(
        self, make_storage: StorageFactory, tmp_path: Path
    ) -> None:
        # fsync=never: the fence itself must be durable
        async with _running(make_storage, tmp_path, fsync="never") as store:
            with trio.fail_after(TIMEOUT):
                await _fill(store, 11, range(3))
                assert await store.fence(11) == 2
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                assert store.segment_info(11).fenced
                with pytest.raises(SegmentFenced):
                    await store.add_entry(11, 3, b"x")
                await store.add_entry(11, 3, entry_payload(11, 3), recovery=True)
                _check(store, 11, range(4))

    # -- restarts ----------------------------------------------------------------------------

    @pytest.mark.parametrize("fsync", ["always", "interval", "never"])
    async def test_restart_keeps_everything(
        self, make_storage: StorageFactory, tmp_path: Path, fsync: str
    ) -> None:
        layout = {1: list(range(50)), 2: [0, 3, 4, 8, 20], 1 << 40: list(range(5, 12))}
        async with _running(make_storage, tmp_path, fsync=fsync) as store:
            with trio.fail_after(TIMEOUT):
                for seg, ids in layout.items():
                    await _fill(store, seg, ids)
                await store.fence(2)
                await store.sync()
        for _ in range(2):
            async with _running(make_storage, tmp_path, fsync=fsync) as store:
                assert store.segments() == sorted(layout)
                for seg, ids in layout.items():
                    _check(store, seg, ids)
                    assert store.read_lac(seg) == ids[-1] - 1
                    assert store.segment_info(seg).fenced == (seg == 2)
                assert store.statistics().segments == len(layout)
        async with _running(make_storage, tmp_path, fsync=fsync) as store:
            with trio.fail_after(TIMEOUT):
                await _fill(store, 1, range(50, 60))  # appends go on where they were
                _check(store, 1, range(60))

    async def test_torn_tail_dropped_at_restart(
        self,
        make_storage: StorageFactory,
        tear_tail: Callable[[Path], None],
        tmp_path: Path,
    ) -> None:
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                await _fill(store, 5, range(10))
                await _fill(store, 6, range(4))
        tear_tail(tmp_path)
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                assert store.statistics().torn_tails >= 1
                _check(store, 5, range(10))  # the entries before it are intact
                _check(store, 6, range(4))
                await _fill(store, 5, range(10, 15))  # and appends go on after them
                await _fill(store, 6, range(4, 6))
        async with _running(make_storage, tmp_path) as store:
            _check(store, 5, range(15))
            _check(store, 6, range(6))
            assert store.statistics().torn_tails == 0

    async def test_corrupt_entry_is_never_returned_and_repaired_by_recovery_add(
        self,
        make_storage: StorageFactory,
        corrupt_entry: Callable[[Path, int, int], None],
        tmp_path: Path,
    ) -> None:
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                for eid in range(10):
                    await store.add_entry(12, eid, entry_payload(12, eid, 500), lac=eid - 1)
        corrupt_entry(tmp_path, 12, 4)
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                for _ in range(2):
                    with pytest.raises(CorruptEntry):
                        store.read_entries(12, 4, 4)
                    with pytest.raises(CorruptEntry):
                        await store.read_entries_async(12, 4, 9)
                # a range read stops before the damaged entry
                assert [e for e, _ in store.read_entries(12, 0, 9)] == [0, 1, 2, 3]
                after = store.read_entries(12, 5, 9)
                assert after == [(e, entry_payload(12, e, 500)) for e in range(5, 10)]
                assert store.statistics().corrupt_entries_detected >= 1
                # other bytes are no repair
                with pytest.raises(InvalidEntryId):
                    await store.add_entry(12, 4, entry_payload(12, 4, 499), recovery=True)
                with pytest.raises(CorruptEntry):
                    store.read_entries(12, 4, 4)
                await store.add_entry(12, 4, entry_payload(12, 4, 500), lac=3, recovery=True)
                assert store.read_entries(12, 4, 4) == [(4, entry_payload(12, 4, 500))]
                assert store.statistics().repaired_entries >= 1
        async with _running(make_storage, tmp_path) as store:
            got = store.read_entries(12, 0, 9)
            assert got == [(e, entry_payload(12, e, 500)) for e in range(10)]

    async def test_kill_9_keeps_every_acknowledged_entry(
        self,
        storage_name: str,
        storage_config: Callable[[Path], dict[str, Any]],
        make_storage: StorageFactory,
        tmp_path: Path,
    ) -> None:
        pytest.importorskip("pigeon.bookie")
        data = tmp_path / "data"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        command = [sys.executable, "-c", _CHILD, storage_name, json.dumps(storage_config(data))]
        acked: dict[int, set[int]] = {}
        lacs: dict[int, int] = {}
        for kill in range(3):  # the later rounds append after a recovery
            # killed after a number of acknowledgements, a different one each round
            lines = await _run_and_kill(command, env, tmp_path / "child.err", 200 + 137 * kill)
            for line in lines:
                seg_field, eid_field, lac_field = line.split()
                acked.setdefault(int(seg_field), set()).add(int(eid_field))
                lacs[int(seg_field)] = max(lacs.get(int(seg_field), -1), int(lac_field))
            async with _running(make_storage, data, fsync="always") as store:
                for seg, ids in acked.items():
                    last = store.last_entry_id(seg)
                    assert last >= max(ids), f"segment {seg} lost acknowledged entries"
                    stored = _read_all(store, seg, 0, last)
                    missing = ids - stored.keys()
                    assert not missing, f"segment {seg}: acknowledged, lost: {missing}"
                    for eid, payload in stored.items():
                        assert payload == entry_payload(seg, eid), f"{seg}/{eid} differs"
                    assert store.read_lac(seg) >= lacs[seg]  # the lacs acknowledged adds gave
        assert sorted(acked) == [1, 2, 3, 4]

    # -- deletion, queries ---------------------------------------------------------------------

    async def test_delete_segment(self, make_storage: StorageFactory, tmp_path: Path) -> None:
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                await _fill(store, 20, range(30))
                await _fill(store, 21, range(3))
                before = store.statistics().disk_usage_bytes
                await store.delete_segment(20)
                assert store.segments() == [21]
                for query in (store.last_entry_id, store.read_lac, store.segment_info):
                    with pytest.raises(SegmentNotFound):
                        query(20)
                with pytest.raises(SegmentNotFound):
                    store.read_entries(20, 0, 0)
                await store.delete_segment(20)  # a retried delete succeeds
                await store.delete_segment(12345)  # and so does one of an unknown id
                assert store.statistics().segments == 1
                if self.reclaims_on_delete:
                    assert store.statistics().disk_usage_bytes < before
        async with _running(make_storage, tmp_path) as store:
            assert store.segments() == [21]
            with pytest.raises(SegmentNotFound):
                store.read_entries(20, 0, 0)
            _check(store, 21, range(3))

    async def test_segments_ascending(self, make_storage: StorageFactory, tmp_path: Path) -> None:
        ids = [300, 5, 70_000, 1 << 40, 0, 42]
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                assert store.segments() == []
                for seg in ids:
                    await store.add_entry(seg, 0, b"x")
                assert store.segments() == sorted(ids)
        async with _running(make_storage, tmp_path) as store:
            assert store.segments() == sorted(ids)

    async def test_idle_time_follows_the_trio_clock(
        self, make_storage: StorageFactory, tmp_path: Path, mock_clock: trio.testing.MockClock
    ) -> None:
        # the clock moves only when the test jumps it: no timeouts can fire meanwhile
        async with _running(make_storage, tmp_path) as store:
            await store.add_entry(30, 0, b"x")
            await store.add_entry(31, 0, b"y")
            assert store.idle_time(30) < 1.0
            mock_clock.jump(100)
            assert 100 <= store.idle_time(30) < 101
            await store.add_entry(30, 1, b"x")
            assert store.idle_time(30) < 1.0
            assert 100 <= store.idle_time(31) < 101
            mock_clock.jump(50)
            await store.fence(31)
            assert store.idle_time(31) < 1.0
            assert 50 <= store.idle_time(30) < 51
            with pytest.raises(SegmentNotFound):
                store.idle_time(32)

    async def test_statistics(self, make_storage: StorageFactory, tmp_path: Path) -> None:
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                s0 = store.statistics()
                assert isinstance(s0, StoreStatistics)
                assert (s0.segments, s0.entries_written, s0.entries_read) == (0, 0, 0)
                payloads = [entry_payload(40, eid, 1000 + eid) for eid in range(5)]
                for eid, data in enumerate(payloads):
                    await store.add_entry(40, eid, data)
                s1 = store.statistics()
                assert s1.segments == 1
                assert s1.entries_written == 5
                assert s1.bytes_written >= sum(len(p) for p in payloads)
                assert s1.fsyncs > s0.fsyncs and s1.flush_rounds > s0.flush_rounds
                assert s1.disk_usage_bytes >= sum(len(p) for p in payloads)
                assert store.read_entries(40, 0, 4) == list(enumerate(payloads))
                s2 = store.statistics()
                assert s2.entries_read == 5
                assert s2.bytes_read == sum(len(p) for p in payloads)
                assert not s2.read_only and s2.read_only_reason == ""

    async def test_read_only(self, make_storage: StorageFactory, tmp_path: Path) -> None:
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                await store.add_entry(50, 0, b"before")
                assert store.read_only is None
                assert store.set_read_only("disk almost full") is False  # not writable now
                assert store.read_only == "disk almost full"
                with pytest.raises(BookieReadOnly):
                    store.append(50, 1, b"x")
                with pytest.raises(BookieReadOnly):
                    await store.add_entries(51, 0, [b"x"])
                stats = store.statistics()
                assert stats.read_only and stats.read_only_reason == "disk almost full"
                assert store.read_entries(50, 0, 0) == [(0, b"before")]  # reads go on
                assert store.set_read_only(None) is True  # writable again
                assert store.read_only is None
                await store.add_entry(51, 0, b"after")
                assert store.read_entries(51, 0, 0) == [(0, b"after")]

    async def test_many_segments_interleaved(
        self, make_storage: StorageFactory, tmp_path: Path
    ) -> None:
        segments = list(range(100, 124))
        rounds = 15
        async with _running(make_storage, tmp_path) as store:
            with trio.fail_after(TIMEOUT):
                waiters = []
                for eid in range(rounds):
                    for seg in segments:
                        if (seg + eid) % 5 == 0:
                            continue  # some ids skipped, as a striped ensemble does
                        waiters.append(store.append(seg, eid, entry_payload(seg, eid), lac=eid - 1))
                for waiter in waiters:
                    await waiter.wait()
        expected = {seg: [eid for eid in range(rounds) if (seg + eid) % 5] for seg in segments}
        async with _running(make_storage, tmp_path) as store:
            assert store.segments() == segments
            for seg, ids in expected.items():
                _check(store, seg, ids)


async def _run_and_kill(
    command: list[str], env: dict[str, str], err: Path, acks: int
) -> list[bytes]:
    """Run the writer process, SIGKILL it once it printed ``acks`` acknowledgements;
    every complete line it printed (those printed before it died are acknowledged too)."""
    out = b""
    with err.open("wb") as stderr, trio.fail_after(TIMEOUT):
        proc = await trio.lowlevel.open_process(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=env
        )
        try:
            assert proc.stdout is not None
            while out.count(b"\n") < acks:
                chunk = await proc.stdout.receive_some(1 << 16)
                if not chunk:
                    printed = await trio.Path(err).read_bytes()
                    pytest.fail(f"the writer exited: {printed.decode()[-2000:]}")
                out += chunk
            proc.kill()  # SIGKILL
            while chunk := await proc.stdout.receive_some(1 << 16):
                out += chunk
        finally:
            if proc.returncode is None:
                proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
            if proc.stdout is not None:
                await proc.stdout.aclose()
    return out.split(b"\n")[:-1]
