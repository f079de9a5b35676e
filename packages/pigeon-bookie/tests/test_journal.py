"""JournalStore (pigeon.bookie._journal): the ``journal`` ledger storage as a whole, and
the fixtures a contract suite runs it with (``make_storage``, ``tear_tail``,
``corrupt_entry``).

Crash safety (kill -9) is in test_journal_crash; the byte layout in
test_journal_format."""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import pigeon.bookie._journal as journal_mod
import pigeon.bookie._journal_logs as journal_logs_mod
from pigeon.bookie._journal import JournalStore
from pigeon.bookie._journal_format import JOURNAL_MAGIC, RECORD_HEADER_SIZE, encode_file_header
from pigeon.bookie._storage_state import InlineSyncs
from pigeon.bookie.testing import (
    corrupt_journal_entry,
    make_journal_storage,
    tear_journal_tail,
)
from pigeon.core.errors import (
    BookieReadOnly,
    CorruptEntry,
    DataDirLocked,
    EntryNotFound,
    InvalidArgument,
    InvalidEntryId,
    SegmentFenced,
    SegmentNotFound,
    ServiceUnavailable,
    StorageError,
)

# ---------------------------------------------------------------- fixtures


make_storage = make_journal_storage
tear_tail = tear_journal_tail
corrupt_entry = corrupt_journal_entry


def journal_files(path: Path) -> list[Path]:
    return sorted((path / "journal").glob("*.txn"))


@asynccontextmanager
async def open_store(path: Path, **options: Any) -> AsyncIterator[JournalStore]:
    store = make_storage(path, **options)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        yield store
        nursery.cancel_scope.cancel()


def payload(segment_id: int, entry_id: int, size: int | None = None) -> bytes:
    rng = random.Random(segment_id * 1_000_003 + entry_id)
    return rng.randbytes(rng.randrange(0, 3000) if size is None else size)


async def fill(store: JournalStore, segment_id: int, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        await store.add_entry(segment_id, i, payload(segment_id, i), lac=i - 1)


def check_all(store: JournalStore, segment_id: int, n: int) -> None:
    got = store.read_entries(segment_id, 0, n - 1, max_count=n, max_bytes=1 << 30)
    assert [i for i, _ in got] == list(range(n))
    for i, p in got:
        assert p == payload(segment_id, i)


async def hold_the_checkpoint_and_stop(store: JournalStore, nursery: trio.Nursery) -> None:
    """Ask for a checkpoint while holding the lock it needs, then stop the store: the
    checkpoint runs (once the caller releases ``store._index_lock``) after the flusher
    task is gone."""
    import trio.testing

    await store._index_lock.acquire()  # the checkpointer will wait for it
    store._checkpoint_wanted.set()
    await trio.testing.wait_all_tasks_blocked()
    nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- behaviour


async def test_round_trip_limits_and_lac(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        sizes = [0, 1, 100, 5000, 300_000, 1 << 20, 7]
        for i, size in enumerate(sizes):
            await store.add_entry(3, i, payload(3, i, size), lac=i - 1)
        for i, size in enumerate(sizes):
            assert store.read_entries(3, i, i) == [(i, payload(3, i, size))]
        got = await store.read_entries_async(3, 0, 100, max_bytes=64 << 20)
        assert [p for _, p in got] == [payload(3, i, s) for i, s in enumerate(sizes)]
        # max_bytes stops before the entry that would pass it (one entry at least)
        assert [i for i, _ in store.read_entries(3, 0, 6, max_bytes=6000)] == [0, 1, 2, 3]
        assert [i for i, _ in store.read_entries(3, 5, 6, max_bytes=1)] == [5]
        assert [i for i, _ in store.read_entries(3, 0, 6, max_count=2)] == [0, 1]
        info = store.segment_info(3)
        assert (info.last_entry_id, info.lac, info.entry_count) == (6, 5, 7)
        assert info.size_bytes == sum(sizes) + RECORD_HEADER_SIZE * len(sizes)
        with pytest.raises(EntryNotFound):
            store.read_entries(3, 7, 9)
        with pytest.raises(SegmentNotFound):
            store.read_entries(4, 0, 0)
        with pytest.raises(InvalidArgument):
            store.read_entries(3, 2, 1)
    async with open_store(tmp_path) as store:
        assert store.read_lac(3) == 5
        assert store.segment_info(3) == info


async def test_ids_may_skip_but_never_go_back(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await store.add_entry(1, 0, b"a")
        await store.add_entry(1, 1, b"b")
        await store.add_entry(1, 3, b"d")  # striping: 2 is not stored here
        await store.add_entries(1, 10, [b"k", b"l"])
        for bad in (0, 1, 2, 11):
            with pytest.raises(InvalidEntryId):
                await store.add_entry(1, bad, b"z")
        assert store.read_entries(1, 0, 20) == [
            (0, b"a"),
            (1, b"b"),
            (3, b"d"),
            (10, b"k"),
            (11, b"l"),
        ]
        with pytest.raises(EntryNotFound):
            store.read_entries(1, 2, 2)
        with pytest.raises(InvalidEntryId):  # a skipped id is never filled in
            await store.add_entry(1, 2, b"c", recovery=True)
        with pytest.raises(InvalidArgument):
            await store.add_entry(1, 12, memoryview(b"0123")[::2])
        await store.add_entry(1, 12, bytearray(b"ba"))
        await store.add_entry(1, 13, memoryview(b"xmvx")[1:3])
        assert store.read_entries(1, 12, 13) == [(12, b"ba"), (13, b"mv")]
    async with open_store(tmp_path) as store:
        assert [i for i, _ in store.read_entries(1, 0, 20)] == [0, 1, 3, 10, 11, 12, 13]


async def test_fence_and_recovery_adds_survive_restart_without_checkpoint(tmp_path: Path) -> None:
    async with open_store(tmp_path, fsync="never", checkpoint_on_close=False) as store:
        await fill(store, 1, 5)
        assert await store.fence(1) == 4
        with pytest.raises(SegmentFenced):
            await store.add_entry(1, 5, b"late")
        assert await store.fence(1) == 4  # idempotent
        assert await store.fence(2) == -1  # unknown: created fenced and empty
        # recovery adds pass the fence, identical bytes are idempotent
        await store.add_entry(1, 4, payload(1, 4), recovery=True)
        with pytest.raises(InvalidEntryId):
            await store.add_entry(1, 4, b"other bytes", recovery=True)
        await store.add_entry(1, 5, payload(1, 5), lac=4, recovery=True)
    for _ in range(2):  # replayed from the journal, then from the index
        async with open_store(tmp_path) as store:
            assert store.segments() == [1, 2]
            assert store.segment_info(1).fenced and store.segment_info(2).fenced
            assert store.last_entry_id(2) == -1 and store.read_lac(1) == 4
            with pytest.raises(SegmentFenced):
                await store.add_entry(2, 0, b"first")
            check_all(store, 1, 6)


@pytest.mark.parametrize("checkpoint", [True, False])
async def test_restart_after_a_checkpoint_and_after_none(tmp_path: Path, checkpoint: bool) -> None:
    n = {1: 300, 2: 1, 3: 77}
    async with open_store(tmp_path, checkpoint_on_close=checkpoint) as store:
        for seg, count in n.items():
            await fill(store, seg, count)
        before = {seg: store.segment_info(seg) for seg in n}
        assert store.checkpoints == 0
    async with open_store(tmp_path, checkpoint_on_close=False) as store:
        assert store.segments() == sorted(n)
        for seg, count in n.items():
            assert store.segment_info(seg) == before[seg]
            check_all(store, seg, count)
        await fill(store, 2, 10, start=1)  # appends go on after a restart
    async with open_store(tmp_path) as store:
        check_all(store, 2, 11)
        check_all(store, 1, 300)


async def test_group_commit_one_journal_fsync_for_many_segments(tmp_path: Path) -> None:
    async with open_store(tmp_path, flush_interval_ms=1e9) as store:
        start = store.statistics()
        assert store._journal.current is not None
        first_file = store._journal.current.seq

        async def writer(seg: int) -> None:
            for i in range(30):
                await store.add_entry(seg, i, payload(seg, i))

        async with trio.open_nursery() as nursery:
            for seg in range(16):
                nursery.start_soon(writer, seg)
        stats = store.statistics()
        assert stats.entries_written == 480
        rounds = stats.flush_rounds - start.flush_rounds
        # one fdatasync per round whatever the segments written, shared by the adds (a
        # round that moves to the next journal file, a prepared one, syncs both)
        moves = store._journal.current.seq - first_file
        assert stats.fsyncs - start.fsyncs <= rounds + moves + 1
        assert rounds <= 480 // 4
        assert store.checkpoints == 0  # no entry-log fsync on the ack path


@pytest.mark.parametrize("fsync", ["always", "never"])
async def test_entry_logs_are_written_behind_between_checkpoints(
    tmp_path: Path, fsync: str
) -> None:
    """Every flush_entrylog_bytes of an entry log goes to disk (the write-behind) before
    any checkpoint, so the checkpoint's fdatasync is left little; 0 turns it off."""
    size = 4096
    async with open_store(
        tmp_path / "on", fsync=fsync, flush_interval_ms=1e9, flush_entrylog_bytes=64 * 1024
    ) as store:
        await fill_sized(store, 1, 100, size)
        with trio.fail_after(10):
            await store.wait_written_behind()
        assert store.write_behinds >= 1 and store.checkpoints == 0
        log = store._logs.current
        assert log is not None and log.end - log.behind < 64 * 1024  # the rest waits
        check_all_sized(store, 1, 100, size)
    async with open_store(
        tmp_path / "off", fsync=fsync, flush_interval_ms=1e9, flush_entrylog_bytes=0
    ) as store:
        await fill_sized(store, 1, 100, size)
        assert store.write_behinds == 0


async def fill_sized(store: JournalStore, segment_id: int, n: int, size: int) -> None:
    for i in range(n):
        await store.add_entry(segment_id, i, payload(segment_id, i, size))


def check_all_sized(store: JournalStore, segment_id: int, n: int, size: int) -> None:
    got = store.read_entries(segment_id, 0, n - 1)
    assert [(i, bytes(d)) for i, d in got] == [(i, payload(segment_id, i, size)) for i in range(n)]


async def test_append_waiter_and_policies(tmp_path: Path) -> None:
    async with open_store(tmp_path, fsync="always") as store:
        w = store.append(1, 0, b"x")
        assert not w.done and w.error is None
        done: list[bool] = []
        w.add_done_callback(lambda: done.append(True))
        await w.wait()
        assert w.done and w.error is None and done == [True]
    async with open_store(tmp_path, fsync="never", checkpoint_on_close=False) as store:
        rounds = store.statistics().flush_rounds
        w = store.append(1, 1, b"y")
        assert w.done
        await fill(store, 2, 20)
        assert store.statistics().flush_rounds == rounds
        await store.sync()
        assert store.statistics().flush_rounds == rounds + 1
    async with open_store(tmp_path, fsync="interval", fsync_interval_ms=1) as store:
        check_all(store, 2, 20)
        assert store.read_entries(1, 0, 1) == [(0, b"x"), (1, b"y")]


async def test_torn_journal_tail_is_cut(tmp_path: Path) -> None:
    async with open_store(tmp_path, checkpoint_on_close=False) as store:
        await fill(store, 1, 10)
    tear_tail(tmp_path)  # entry 9's record, half written
    size = journal_files(tmp_path)[-1].stat().st_size
    async with open_store(tmp_path, checkpoint_on_close=False) as store:
        assert store.last_entry_id(1) == 8
        check_all(store, 1, 9)
        assert store.statistics().torn_tails == 1
        await fill(store, 1, 1, start=9)  # the id is free again
    assert all(p.stat().st_size < size for p in journal_files(tmp_path)[:1])
    async with open_store(tmp_path) as store:
        check_all(store, 1, 10)
        assert store.statistics().torn_tails == 0
    tear_tail(tmp_path)  # half a record after the checkpoint
    async with open_store(tmp_path) as store:
        check_all(store, 1, 10)
        assert store.statistics().torn_tails == 1


async def test_corrupt_entry_log_record_and_repair(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 10)
    corrupt_entry(tmp_path, 1, 4)
    async with open_store(tmp_path) as store:
        with pytest.raises(CorruptEntry):
            store.read_entries(1, 4, 4)
        # a range stops before the damaged entry; never returns it
        assert [i for i, _ in store.read_entries(1, 0, 9)] == [0, 1, 2, 3]
        assert [i for i, _ in store.read_entries(1, 5, 9)] == [5, 6, 7, 8, 9]
        assert store.segment_info(1).corrupt_entries == 1
        stats = store.statistics()
        assert stats.damaged_entries == 1 and stats.corrupt_entries_detected >= 1
        with pytest.raises(CorruptEntry):
            await store.read_entries_async(1, 4, 9)
        # a recovery add with the good copy writes it anew and the index points at it
        await store.fence(1)
        await store.add_entry(1, 4, payload(1, 4), recovery=True)
        check_all(store, 1, 10)
        assert store.statistics().repaired_entries == 1
        assert store.statistics().damaged_entries == 0
    for _ in range(2):  # after a checkpoint, then from the index
        async with open_store(tmp_path) as store:
            check_all(store, 1, 10)


async def test_repair_survives_a_restart_without_checkpoint(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 5)
    corrupt_entry(tmp_path, 1, 0)
    async with open_store(tmp_path, checkpoint_on_close=False) as store:
        with pytest.raises(CorruptEntry):
            store.read_entries(1, 0, 4)
        await store.add_entry(1, 0, payload(1, 0), recovery=True)
    async with open_store(tmp_path) as store:
        check_all(store, 1, 5)


async def test_delete_segment_is_durable(tmp_path: Path) -> None:
    async with open_store(tmp_path, checkpoint_on_close=False) as store:
        await fill(store, 1, 20)
        await fill(store, 2, 20)
        await store.checkpoint()
        await store.fence(2)
        await store.delete_segment(2)
        assert store.segments() == [1]
        with pytest.raises(SegmentNotFound):
            store.read_entries(2, 0, 0)
        await store.delete_segment(2)  # a retried delete is fine
        await store.delete_segment(99)
        await store.add_entry(3, 0, b"new")
        await store.delete_segment(3)  # never indexed
    for _ in range(2):  # replayed (delete record), then from the index
        async with open_store(tmp_path) as store:
            assert store.segments() == [1]
            check_all(store, 1, 20)
    async with open_store(tmp_path) as store:  # the same id may be used again
        await store.add_entry(2, 0, b"again")
        assert store.read_entries(2, 0, 5) == [(0, b"again")]


async def test_delete_while_reading_in_a_thread(tmp_path: Path) -> None:
    async with open_store(tmp_path, inline_read_bytes=0) as store:
        await fill(store, 1, 50)
        results: list[int] = []
        async with trio.open_nursery() as nursery:

            async def reader() -> None:
                results.append(len(await store.read_entries_async(1, 0, 49)))

            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(store.delete_segment, 1)
        assert results == [50] and store.segments() == []


async def test_compaction_keeps_live_entries_readable(tmp_path: Path) -> None:
    opts: dict[str, Any] = {"entry_log_size_limit": 64 << 10, "flush_interval_ms": 1e9}
    async with open_store(tmp_path, **opts) as store:
        # two segments interleaved in the same entry logs
        for i in range(200):
            for seg in (1, 2):
                await store.add_entry(seg, i, payload(seg, i))
        await store.checkpoint()
        logs_before = len(list((tmp_path / "ledgers").glob("*.log")))
        usage = log_bytes(tmp_path)
        assert logs_before > 4
        await store.delete_segment(2)
        assert await store.compact(0.0) == 0  # nothing under 0% live
        removed = await store.compact(0.9)
        assert removed >= logs_before - 2
        assert len(list((tmp_path / "ledgers").glob("*.log"))) < logs_before
        assert log_bytes(tmp_path) < usage * 0.6
        check_all(store, 1, 200)
        await fill(store, 1, 10, start=200)
        # a segment wholly deleted frees its logs at the next checkpoint, no compaction
        await store.delete_segment(1)
        await store.checkpoint()
        assert len(list((tmp_path / "ledgers").glob("*.log"))) == 1  # the current one
        await fill(store, 5, 3)
    async with open_store(tmp_path, **opts) as store:
        assert store.segments() == [5]
        check_all(store, 5, 3)


def log_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / "ledgers").glob("*.log"))


async def test_journal_rolls_and_old_files_go_after_a_checkpoint(tmp_path: Path) -> None:
    async with open_store(tmp_path, journal_max_size_mb=0.02, flush_interval_ms=1e9) as store:
        await fill(store, 1, 100)
        assert len(journal_files(tmp_path)) > 3
        await store.checkpoint()
        assert len(journal_files(tmp_path)) == 1
        await fill(store, 1, 50, start=100)
    async with open_store(tmp_path) as store:
        check_all(store, 1, 150)


async def test_journal_and_ledgers_on_different_directories(tmp_path: Path) -> None:
    journal, ledgers = (
        tmp_path / "disk1" / "j",
        [tmp_path / "disk2" / "l", tmp_path / "disk3" / "l"],
    )

    @asynccontextmanager
    async def running() -> AsyncIterator[JournalStore]:
        store = JournalStore(journal, ledgers, entry_log_size_limit=32 << 10)
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            yield store
            nursery.cancel_scope.cancel()

    async with running() as store:
        await fill(store, 7, 100)
    assert list(journal.glob("*.txn")) and not list(journal.glob("*.log"))
    assert all(list(d.glob("*.log")) for d in ledgers)  # logs spread over both
    assert (ledgers[0] / "index").is_dir()
    async with running() as store:
        check_all(store, 7, 100)
        with pytest.raises(DataDirLocked):
            await JournalStore(journal, ledgers).run()


async def test_many_segments_interleaved(tmp_path: Path) -> None:
    rng = random.Random(7)
    counts = dict.fromkeys(range(100, 150), 0)
    async with open_store(tmp_path, checkpoint_on_close=False, flush_entries=300) as store:
        for _ in range(1500):
            seg = rng.choice(list(counts))
            await store.add_entry(seg, counts[seg], payload(seg, counts[seg]), lac=counts[seg] - 1)
            counts[seg] += 1
        assert store.checkpoints >= 2  # some indexed, some only in the journal
    async with open_store(tmp_path) as store:
        assert store.segments() == sorted(s for s, c in counts.items() if c)
        for seg, c in counts.items():
            if c:
                check_all(store, seg, c)
                assert store.read_lac(seg) == c - 2


async def test_fsync_error_turns_the_store_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 2)
        monkeypatch.setattr(
            journal_mod, "fsync_many", lambda fds, d, drops=(): OSError(5, "I/O error")
        )
        with pytest.raises(BookieReadOnly):
            await store.add_entry(1, 2, b"x")
        with pytest.raises(BookieReadOnly):
            await store.add_entry(1, 3, b"x")
        assert store.statistics().read_only
        assert not store.set_read_only(None)  # lasts until a restart
        monkeypatch.undo()
    async with open_store(tmp_path) as store:
        await store.add_entry(1, 3, b"y")
        assert store.last_entry_id(1) == 3


async def test_an_entry_is_readable_before_its_round_wrote_the_entry_log(tmp_path: Path) -> None:
    """fsync=always: the round writes the entry log; until then reads come from memory,
    and afterwards from the log (the same bytes)."""
    async with open_store(tmp_path) as store:
        waiters = [store.append(7, i, payload(7, i), lac=i - 1) for i in range(5)]
        assert not any(w.done for w in waiters)
        check_all(store, 7, 5)  # nothing written to the entry log yet
        assert await store.read_entries_async(7, 0, 4) == store.read_entries(7, 0, 4)
        for w in waiters:
            await w.wait()
        assert not store._unwritten
        check_all(store, 7, 5)


@pytest.mark.parametrize("policy", ["never", "interval"])
async def test_entry_log_writes_are_batched_without_a_round_per_add(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """fsync=never/interval: an add writes the journal only; its entry-log record is
    written with the others, once _LOG_BATCH_BYTES are due (one vectored write for
    them all) or by the next round (here the checkpoint's), read from memory until
    then; a restart finds them all."""
    writes: list[int] = []
    real = journal_mod.write_reserved

    def counting(batch: Any) -> OSError | None:
        writes.append(len(batch))
        return real(batch)

    monkeypatch.setattr(journal_mod, "write_reserved", counting)
    monkeypatch.setattr(journal_mod, "_LOG_BATCH_BYTES", 10_000)
    options: dict[str, Any] = {"fsync": policy}
    if policy == "interval":
        options["fsync_interval_ms"] = 3_600_000.0  # no round comes during the test

    def check(store: JournalStore, n: int) -> None:
        got = store.read_entries(3, 0, n - 1, max_count=n, max_bytes=1 << 30)
        assert got == [(i, payload(3, i, 1000)) for i in range(n)]

    async with open_store(tmp_path, **options) as store:
        for i in range(9):  # 9 * 1000 bytes: below the batch
            store.append(3, i, payload(3, i, 1000), lac=i - 1)
        assert writes == [] and len(store._unwritten) == 9
        check(store, 9)  # from memory
        store.append(3, 9, payload(3, 9, 1000), lac=8)  # the batch is due
        assert writes == [10] and not store._unwritten
        store.append(3, 10, payload(3, 10, 1000), lac=9)
        await store.checkpoint()  # its round writes the rest
        assert writes == [10, 1] and not store._unwritten
        check(store, 11)
    async with open_store(tmp_path) as store:
        check(store, 11)


async def test_a_failed_entry_log_write_keeps_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal made the entries durable, so they are acknowledged and read (from
    memory); no checkpoint lets the journal go until their log write succeeds (tried
    again by each checkpoint), and a restart before that replays them."""
    async with open_store(tmp_path, checkpoint_on_close=False) as store:
        await fill(store, 1, 3)
        monkeypatch.setattr(journal_mod, "write_reserved", lambda writes: OSError(28, "No space"))
        # one round: acknowledged, since the journal has them
        await store.add_entries(1, 3, [payload(1, i) for i in range(3, 6)], lac=2)
        check_all(store, 1, 6)
        with pytest.raises(BookieReadOnly):  # until the entry logs can be written
            await store.add_entry(1, 6, b"x")
        with pytest.raises(StorageError, match="entry-log write failed"):
            await store.checkpoint()
        assert journal_files(tmp_path)[0].stat().st_size > 0
    monkeypatch.undo()
    async with open_store(tmp_path) as store:  # replayed from the journal
        check_all(store, 1, 6)
        await store.checkpoint()
        check_all(store, 1, 6)


@pytest.mark.parametrize("size", [1000, 300_000], ids=["same-thread", "own-thread"])
async def test_a_failed_entry_log_write_is_written_by_the_next_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    real = journal_logs_mod.write_reserved
    calls = 0

    def fail_once(writes: Any) -> OSError | None:
        nonlocal calls
        calls += 1
        return OSError(28, "No space left on device") if calls == 1 else real(writes)

    async with open_store(tmp_path) as store:
        monkeypatch.setattr(journal_mod, "write_reserved", fail_once)
        await store.add_entries(2, 0, [payload(2, i, size) for i in range(4)])
        assert store._unwritten  # the round's entries: in memory only
        store.set_read_only(None)  # the disk has room again
        await store.checkpoint()
        assert not store._unwritten and not store._failed_writes
        got = store.read_entries(2, 0, 3, max_bytes=1 << 30)
        assert got == [(i, payload(2, i, size)) for i in range(4)]
    async with open_store(tmp_path) as store:
        assert store.read_entries(2, 0, 3, max_bytes=1 << 30) == got


async def test_statistics_and_lifecycle(tmp_path: Path) -> None:
    store = make_storage(tmp_path)
    with pytest.raises(ServiceUnavailable):
        await store.add_entry(1, 0, b"x")
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        await fill(store, 1, 10)
        store.read_entries(1, 0, 9)
        stats = store.statistics()
        assert (stats.segments, stats.entries_written, stats.entries_read) == (1, 10, 10)
        assert stats.bytes_read == sum(len(payload(1, i)) for i in range(10))
        assert stats.bytes_written == stats.bytes_read + 10 * RECORD_HEADER_SIZE
        assert stats.fsyncs >= stats.flush_rounds >= 1 and stats.disk_usage_bytes > 0
        assert store.set_read_only("disk full") is False
        with pytest.raises(BookieReadOnly):
            await store.add_entry(1, 10, b"x")
        assert store.set_read_only(None) is True
        nursery.cancel_scope.cancel()
    with pytest.raises(ServiceUnavailable):
        store.read_entries(1, 0, 0)
    with pytest.raises(RuntimeError):
        await store.run()


def test_bad_arguments() -> None:
    for kw in (
        {"fsync": "sometimes"},
        {"fsync_interval_ms": 0},
        {"journal_max_size_mb": 0},
        {"entry_log_size_limit": 10},
        {"minor_compaction_threshold": 2},
        {"journal_max_group_wait_ms": -1},
        {"journal_inline_sync_max_bytes": -1},
        {"journal_inline_sync_max_ms": 0},
    ):
        with pytest.raises(InvalidArgument):
            JournalStore("j", "l", **kw)
    with pytest.raises(InvalidArgument):
        JournalStore("j", [])


def test_registered_as_journal(tmp_path: Path) -> None:
    from pigeon.bookie import _cli
    from pigeon.bookie._service import BookieConfig
    from pigeon.core import PluginManager

    plugins = PluginManager(load_entry_points=False, extra_plugins=(_cli,))
    assert "segment-files" in plugins.ledger_storages
    factory = plugins.ledger_storages.get("journal")
    store = factory(BookieConfig(data_dir=str(tmp_path), journal_max_group_wait_ms=1.0))
    assert isinstance(store, JournalStore)
    assert store._journal_dir == tmp_path / "journal"
    assert store._ledger_dirs == [tmp_path / "ledgers"]


async def test_a_checkpoint_running_while_the_store_stops_completes(tmp_path: Path) -> None:
    """The background checkpoint (shielded) forcing a journal round after the flusher
    task stopped must not wait for it forever: the store stops, every add is kept."""
    import trio.testing

    store = make_storage(tmp_path, flush_entries=10_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        await fill(store, 3, 5)
        await hold_the_checkpoint_and_stop(store, nursery)
        with trio.CancelScope(shield=True):
            await trio.testing.wait_all_tasks_blocked()  # the flusher has stopped
            store._index_lock.release()  # the checkpoint goes on, past the flusher
            with trio.move_on_after(10):  # its fsyncs run in threads: poll, bounded
                while store._state == "running":  # noqa: ASYNC110
                    await trio.sleep(0.01)
            stuck = store._state == "running"
            if stuck:  # unstick it, so that the failure is reported, not a hang
                store._collecting.finish()
        assert not stuck, "the checkpoint waited for a flusher that had stopped"
    async with open_store(tmp_path) as store:
        check_all(store, 3, 5)


# ---------------------------------------------------------------- hostile data dirs


async def refused(path: Path) -> StorageError:
    """The StorageError a store on ``path`` refuses to start with (bounded: a store
    that starts fails the test)."""
    store = make_storage(path)
    with trio.fail_after(10), pytest.raises(StorageError) as info:
        await store.run()
    return info.value


@pytest.mark.parametrize("where", ["journal", "ledgers/index", "ledgers"])
async def test_a_data_dir_that_cannot_be_opened_is_a_storage_error(
    tmp_path: Path, where: str
) -> None:
    # a file where a directory goes (or a disk that fails): one typed line at start
    # (the bookie command prints it), not an OSError traceback
    async with open_store(tmp_path) as store:
        await fill(store, 1, 5)
    target = tmp_path / where
    if target.is_dir():
        for p in sorted(target.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        target.rmdir()
    target.write_bytes(b"not a directory")
    error = await refused(tmp_path)
    assert where.split("/")[-1] in str(error) and "\n" not in str(error)


async def test_stray_files_with_store_names_do_not_stop_it(tmp_path: Path) -> None:
    # files named like entry logs or journal files that the store never wrote (ids it
    # never reaches) are left alone: the store starts and its segments read back
    async with open_store(tmp_path, checkpoint_on_close=False) as store:
        await fill(store, 1, 5)
    (tmp_path / "ledgers" / "ffffffffffffffff.log").write_bytes(b"junk")
    stray = tmp_path / "journal" / "ffffffffffffffff.txn"
    stray.write_bytes(encode_file_header(JOURNAL_MAGIC, (1 << 64) - 1) + b"junk")
    for n in (5, 10):
        async with open_store(tmp_path) as store:
            check_all(store, 1, n)
            await fill(store, 1, 5, start=n)
    async with open_store(tmp_path) as store:
        check_all(store, 1, 15)


@pytest.mark.parametrize("how", ["deleted", "emptied"])
async def test_a_lost_index_stops_the_store_and_keeps_the_entry_logs(
    tmp_path: Path, how: str
) -> None:
    # the journal before the last checkpoint is gone: without its index the store
    # would start empty (its segments lost to the brokers) and then delete the entry
    # logs nothing points into; it refuses instead, and starts once the index is back
    async with open_store(tmp_path, journal_max_size_mb=0.01) as store:
        await fill(store, 1, 60)
        await store.checkpoint()
    async with open_store(tmp_path, journal_max_size_mb=0.01) as store:
        check_all(store, 1, 60)
    index = tmp_path / "ledgers" / "index"
    saved = tmp_path / "saved-index"
    shutil.copytree(index, saved)
    if how == "deleted":
        shutil.rmtree(index)
    else:
        (index / "data.mdb").write_bytes(b"")
    logs = sorted((tmp_path / "ledgers").glob("*.log"))
    for _ in range(2):
        error = await refused(tmp_path)
        assert "index" in str(error) and "\n" not in str(error)
    assert all(log.exists() for log in logs)
    shutil.rmtree(index)
    shutil.copytree(saved, index)
    async with open_store(tmp_path) as store:
        check_all(store, 1, 60)


@pytest.mark.parametrize("rolled", [False, True])
async def test_a_damaged_journal_file_header_loses_no_record(tmp_path: Path, rolled: bool) -> None:
    # bit rot in the 16-byte header of a journal file holding acknowledged adds not yet
    # checkpointed: its records (each with its own crc) are replayed, not deleted.  The
    # adds may span two files (the first file after a start is left once the next one
    # is prepared): every file's header is damaged
    size = {"journal_max_size_mb": 0.002} if rolled else {}
    async with open_store(
        tmp_path, checkpoint_on_close=False, flush_interval_ms=1e9, **size
    ) as store:
        await fill(store, 1, 10)
    assert len(journal_files(tmp_path)) > 1 or not rolled
    for damaged in journal_files(tmp_path):
        fd = os.open(damaged, os.O_RDWR)
        try:
            os.pwrite(fd, b"\0" * 8, 0)
        finally:
            os.close(fd)
    for _ in range(2):
        async with open_store(tmp_path) as store:
            check_all(store, 1, 10)


async def test_a_log_write_failing_while_a_checkpoint_retries_is_not_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round whose entry-log write fails while the checkpoint writes the earlier
    failed ones again (disk full, space coming and going): its entries stay in memory
    and in the journal until a later checkpoint writes them (they were acknowledged)."""
    import threading

    real = journal_logs_mod.write_reserved
    calls = 0
    retrying = trio.Event()
    gate = threading.Event()

    def flaky(writes: Any) -> OSError | None:
        nonlocal calls
        calls += 1
        if calls == 2:  # the checkpoint's retry: held until the next round failed
            err = real(writes)
            trio.from_thread.run_sync(retrying.set)
            gate.wait(10)
            return err
        if calls in (1, 3):
            return OSError(28, "No space left on device")
        return real(writes)

    async with open_store(tmp_path, checkpoint_on_close=False) as store:
        monkeypatch.setattr(journal_mod, "write_reserved", flaky)
        await store.add_entries(1, 0, [payload(1, i) for i in range(2)])
        store.set_read_only(None)  # room again
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.checkpoint)
            await retrying.wait()
            store.set_read_only(None)
            await store.add_entries(1, 2, [payload(1, i) for i in range(2, 4)], lac=1)
            gate.set()
        check_all(store, 1, 4)  # entries 2 and 3: still from memory
        store.set_read_only(None)
        await store.checkpoint()  # writes them
        assert not store._unwritten and not store._failed_writes
        check_all(store, 1, 4)
    async with open_store(tmp_path) as store:
        check_all(store, 1, 4)


async def test_a_checkpoint_while_stopping_waits_for_a_round_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopping, the flusher is gone and a round is flushed by whoever forces it (a
    sync from a connection, the checkpoint): the checkpoint must not fsync the entry
    logs and let the journal go while an earlier round still writes them, and no round
    may write an entry log after the store closed it."""
    import threading

    import trio.testing

    real = journal_logs_mod.write_reserved
    in_write, gate = threading.Event(), threading.Event()

    def slow_log_thread(writes: Any) -> OSError | None:
        if threading.current_thread().name == "pigeon-journal-logs":
            in_write.set()
            gate.wait(10)
        return real(writes)

    big = payload(1, 0, 300_000)  # a round of its own thread for the entry log
    store = make_storage(tmp_path, journal_max_size_mb=0.25)  # and a journal roll
    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            await fill(store, 2, 3)
            monkeypatch.setattr(journal_mod, "write_reserved", slow_log_thread)
            await hold_the_checkpoint_and_stop(store, nursery)
            with trio.CancelScope(shield=True):
                await trio.testing.wait_all_tasks_blocked()  # the flusher has stopped
                waiter = store.append(1, 0, big)
                outer.start_soon(store.sync)  # the round: its log write held
                await trio.to_thread.run_sync(in_write.wait, 10)
                store._index_lock.release()  # the checkpoint, then the shutdown
                with trio.move_on_after(10):  # threads at work: poll, bounded
                    # closed: the checkpoint went past the round (it fsynced the
                    # logs and let the journal go without the round's entries)
                    while store._state != "closed":
                        if store._round_lock.statistics().tasks_waiting:
                            break  # the checkpoint waits for the round
                        await trio.sleep(0.01)
                gate.set()
        await waiter.wait()
    monkeypatch.undo()
    async with open_store(tmp_path) as store:
        check_all(store, 2, 3)
        assert store.read_entries(1, 0, 0, max_bytes=1 << 30) == [(0, big)]


# ---------------------------------------------------------------- inline rounds


async def test_small_rounds_run_inline_large_ones_on_the_thread(tmp_path: Path) -> None:
    """A round of at most journal_inline_sync_max_bytes runs on the event loop (no
    thread hop on the ack path); a larger one on the sync thread; both are durable."""
    # max_ms: this test is about sizes, not about a disk found slow on a busy machine
    options = {"journal_inline_sync_max_bytes": 4096, "journal_inline_sync_max_ms": 60_000}
    async with open_store(tmp_path, **options) as store:
        await store.add_entry(9, 0, b"w", lac=-1)  # the first round also syncs the dir
        inline = store.statistics().inline_flush_rounds
        await store.add_entry(1, 0, b"x" * 100, lac=-1)
        assert store.statistics().inline_flush_rounds == inline + 1
        inline += 1
        rounds = store.statistics().flush_rounds
        await store.add_entry(1, 1, b"y" * 20_000, lac=0)
        st = store.statistics()
        assert st.flush_rounds > rounds
        assert st.inline_flush_rounds == inline, "a 20 KB round ran inline"
        await store.add_entry(1, 2, b"z" * 100, lac=1)
        assert store.statistics().inline_flush_rounds == inline + 1
    async with open_store(tmp_path) as store:  # replayed / read back after a restart
        got = store.read_entries(1, 0, 2, max_count=3, max_bytes=1 << 20)
        assert [p for _, p in got] == [b"x" * 100, b"y" * 20_000, b"z" * 100]


async def test_inline_rounds_off(tmp_path: Path) -> None:
    async with open_store(tmp_path, journal_inline_sync_max_bytes=0) as store:
        await fill(store, 1, 5)
        st = store.statistics()
        assert st.flush_rounds >= 1 and st.inline_flush_rounds == 0
        check_all(store, 1, 5)


async def test_a_slow_disk_sends_rounds_back_to_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk slower than journal_inline_sync_max_ms must not hold the event loop (and
    every other connection of the process) round after round: once half of the recent
    inline rounds were slow, the next ones go to the sync thread."""
    real = os.fdatasync
    slow = [True]

    def fdatasync(fd: int) -> None:
        if slow[0]:
            import time

            time.sleep(0.003)  # a disk that takes 3 ms, over the 1 ms allowed
        real(fd)

    async with open_store(tmp_path, journal_inline_sync_max_ms=1.0) as store:
        await store.add_entry(9, 0, b"w", lac=-1)  # the first round also syncs the dir
        inline = store.statistics().inline_flush_rounds
        monkeypatch.setattr(os, "fdatasync", fdatasync)
        await fill(store, 1, 20)
        half = InlineSyncs.WINDOW // 2
        assert store.statistics().inline_flush_rounds == inline + half
        assert store._inline.slow == 1
        slow[0] = False
        rounds = store.statistics().flush_rounds
        await fill(store, 2, 3)
        st = store.statistics()
        assert st.flush_rounds >= rounds + 3
        assert st.inline_flush_rounds == inline + half, "inline again on a slow disk"
        store._inline._until = -1.0  # the cooldown over: inline again
        await store.add_entry(3, 0, b"b", lac=-1)
        assert store.statistics().inline_flush_rounds == inline + half + 1
        check_all(store, 1, 20)


def test_a_lone_hiccup_keeps_rounds_inline_a_long_stall_does_not() -> None:
    syncs = InlineSyncs(65536, 0.002)
    for _ in range(100):  # fast rounds, with a 30 ms hiccup now and then
        syncs.ran(0.0004)
        syncs.ran(0.0003)
        syncs.ran(0.030 if _ % 10 == 0 else 0.0005)
    assert syncs.slow == 0 and syncs.allowed(1000)
    assert not syncs.allowed(65537)
    syncs.ran(0.120)  # one round held the loop (every connection) 120 ms
    assert syncs.slow == 1 and not syncs.allowed(1000)
    syncs._until = -1.0
    for _ in range(InlineSyncs.WINDOW // 2 - 1):  # a disk slow for a while
        syncs.ran(0.003)
        syncs.ran(0.0004)
    assert syncs.slow == 1
    syncs.ran(0.003)
    assert syncs.slow == 2 and not syncs.allowed(1000)
