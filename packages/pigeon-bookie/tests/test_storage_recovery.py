"""Recovery and repair (pigeon.bookie._storage_recovery): damaged segment files, what
a starting store says about them and does with them, and repairs.

Damage is made the way an operator or a failing disk makes it: the data file of a
stopped store is truncated, or a bit in it is flipped, or its index is lost; then the
store starts again.
"""

from __future__ import annotations

import functools
import logging
import os
import random
from pathlib import Path
from typing import Any

import pytest
import test_storage
from test_storage import check_all, files, fill

from pigeon.bookie._segment import FILE_HEADER_SIZE, RECORD_HEADER_SIZE, encode_record_header
from pigeon.bookie._storage import SegmentStore
from pigeon.core.errors import CorruptEntry, EntryNotFound, InvalidEntryId, StorageError

LOGGER = "pigeon.bookie._storage"


def payload(entry_id: int, size: int = 500) -> bytes:
    return random.Random(entry_id).randbytes(size)


#: a running store on a data directory (no fsync: these tests stop it cleanly)
open_store = functools.partial(test_storage.open_store, fsync="never")


def log_file(path: Path, segment_id: int = 1) -> Path:
    return path / "segments" / f"{segment_id:016x}.log"


async def write(path: Path, n: int, *, fence: bool = False, **kw: Any) -> list[int]:
    """Entries 0..n-1 of segment 1 (each add piggybacks lac = its id - 1); where each
    record starts."""
    async with open_store(path, **kw) as store:
        for i in range(n):
            await store.add_entry(1, i, payload(i), lac=i - 1)
        if fence:
            await store.fence(1)
        return list(store._segments[1].starts)


def flip(path: Path, pos: int, mask: int = 0x10) -> None:
    data = bytearray(log_file(path).read_bytes())
    data[pos] ^= mask
    log_file(path).write_bytes(data)


def lines(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


# ----------------------------------------------------------------------------- start


async def test_truncated_tail_is_logged_with_what_was_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    starts = await write(tmp_path, 10)
    # cut inside entry 8's payload: 8 is torn, 9 is gone
    cut = starts[8] + RECORD_HEADER_SIZE + 100
    with log_file(tmp_path).open("r+b") as f:
        f.truncate(cut)
    caplog.set_level(logging.INFO, LOGGER)
    async with open_store(tmp_path) as store:
        assert store.last_entry_id(1) == 7
        stats = store.statistics()
        assert (stats.torn_tails, stats.torn_entries) == (1, 1)
    (line,) = lines(caplog, "torn tail truncated")
    assert line.levelno == logging.WARNING
    msg = line.getMessage()
    assert "segment=1" in msg and "kept_last_entry=7" in msg and "dropped_entries=8 " in msg
    assert f"bytes={cut - starts[8]}" in msg
    (summary,) = lines(caplog, "segment store open")
    assert "torn_tails=1" in summary.getMessage()


async def test_lost_confirmed_entries_are_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fenced segment's meta file records the writer's lac: a tail cut below it lost
    entries that were acknowledged, and the log says so."""
    starts = await write(tmp_path, 10, fence=True)  # lac 8 recorded by the fence
    with log_file(tmp_path).open("r+b") as f:
        f.truncate(starts[6] + 7)
    caplog.set_level(logging.INFO, LOGGER)
    async with open_store(tmp_path) as store:
        assert store.last_entry_id(1) == 5
        # the bookie lacks them; a recovery add (a repair from a replica) refills the tail
        for i in range(6, 10):
            await store.add_entry(1, i, payload(i), recovery=True)
        assert [i for i, _ in store.read_entries(1, 0, 9)] == list(range(10))
    (line,) = lines(caplog, "torn tail truncated")
    assert line.levelno == logging.ERROR
    assert "entries 6..8 were acknowledged" in line.getMessage()


async def test_damage_near_the_end_is_found_at_start_not_only_by_a_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Checkpoints every 100 bytes: the damage is far before the last one, but within
    the verified tail window (the whole, small, file)."""
    starts = await write(tmp_path, 20, index_interval_bytes=100)
    flip(tmp_path, starts[3] + RECORD_HEADER_SIZE + 10)
    caplog.set_level(logging.INFO, LOGGER)
    async with open_store(tmp_path, index_interval_bytes=100) as store:
        assert store.statistics().damaged_entries == 1
        (line,) = lines(caplog, "damaged entries found at start")
        assert line.levelno == logging.ERROR
        assert "segment=1 count=1 entries=3" in line.getMessage()
        with pytest.raises(CorruptEntry):
            store.read_entries(1, 3, 3)
        assert [i for i, _ in store.read_entries(1, 4, 19)] == list(range(4, 20))


async def test_start_verifies_a_bounded_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the last ``verify_tail_bytes`` are read at start: damage before them is
    found (and reported once) by the read that meets it."""
    starts = await write(tmp_path, 40, index_interval_bytes=1000)
    flip(tmp_path, starts[2] + RECORD_HEADER_SIZE + 10)
    caplog.set_level(logging.INFO, LOGGER)
    async with open_store(tmp_path, index_interval_bytes=1000, verify_tail_bytes=4000) as store:
        stats = store.statistics()
        assert stats.damaged_entries == 0
        size = log_file(tmp_path).stat().st_size
        (summary,) = lines(caplog, "segment store open")
        verified = int(summary.getMessage().split("verified_bytes=")[1].split()[0])
        assert 4000 <= verified < size // 2
        for _ in range(3):
            with pytest.raises(CorruptEntry):
                store.read_entries(1, 2, 2)
        assert len(lines(caplog, "damaged entry not returned")) == 1  # logged once
        assert store.statistics().damaged_entries == 1


# ----------------------------------------------------------------------------- repair


@pytest.mark.parametrize("dense_window", [None, 2])
async def test_recovery_add_repairs_a_damaged_payload_in_place(
    tmp_path: Path, dense_window: int | None
) -> None:
    starts = await write(tmp_path, 30, index_interval_bytes=1000)
    flip(tmp_path, starts[11] + RECORD_HEADER_SIZE + 200)
    async with open_store(tmp_path, index_interval_bytes=1000, dense_window=dense_window) as store:
        with pytest.raises(CorruptEntry):
            store.read_entries(1, 11, 11)
        with pytest.raises(InvalidEntryId):  # other bytes never land there
            await store.add_entry(1, 11, payload(12), recovery=True)
        await store.add_entry(1, 11, payload(11), recovery=True)
        assert store.read_entries(1, 11, 11) == [(11, payload(11))]
        stats = store.statistics()
        assert (stats.repaired_entries, stats.damaged_entries) == (1, 0)
        await store.add_entry(1, 11, payload(11), recovery=True)  # idempotent
        assert store.statistics().repaired_entries == 1
    async with open_store(tmp_path, index_interval_bytes=1000) as store:
        assert store.read_entries(1, 0, 29, max_count=30) == [(i, payload(i)) for i in range(30)]


async def test_recovery_add_rewrites_a_record_whose_header_was_damaged(tmp_path: Path) -> None:
    starts = await write(tmp_path, 12)
    flip(tmp_path, starts[5] + 12)  # inside entry 5's header: the record is lost
    async with open_store(tmp_path) as store:
        with pytest.raises(CorruptEntry):
            store.read_entries(1, 5, 5)
        with pytest.raises(InvalidEntryId):  # not the size of the damaged bytes
            await store.add_entry(1, 5, payload(5, 499), recovery=True)
        await store.add_entry(1, 5, payload(5), recovery=True)
        assert store.read_entries(1, 0, 11) == [(i, payload(i)) for i in range(12)]
    async with open_store(tmp_path) as store:
        assert store.statistics().damaged_entries == 0
        assert store.read_entries(1, 0, 11) == [(i, payload(i)) for i in range(12)]


async def test_a_skipped_id_is_never_filled_in(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await store.add_entry(1, 0, b"a")
        await store.add_entry(1, 2, b"c")
        with pytest.raises(EntryNotFound):
            store.read_entries(1, 1, 1)
        with pytest.raises(InvalidEntryId):
            await store.add_entry(1, 1, b"b", recovery=True)


async def test_a_segment_of_damaged_records_is_kept_not_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whole records failing their checksum are damage, not an add cut short: the
    segment stays known (empty), so that a replica can refill it."""
    starts = await write(tmp_path, 5)
    for pos in starts:
        flip(tmp_path, pos + RECORD_HEADER_SIZE + 1)
    caplog.set_level(logging.INFO, LOGGER)
    async with open_store(tmp_path) as store:
        assert store.segments() == [1]
        assert store.last_entry_id(1) == -1
        for i in range(5):  # refilled from a good copy
            await store.add_entry(1, i, payload(i), recovery=True)
        assert store.read_entries(1, 0, 4) == [(i, payload(i)) for i in range(5)]
    (line,) = lines(caplog, "torn tail truncated")
    assert "dropped_entries=0..4 (5 records, 5 whole but failing their checksum)" in (
        line.getMessage()
    )


# ----------------------------------------------------------------------------- more damage


async def test_torn_tail_is_truncated(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 10)
        size = store.segment_info(1).size_bytes
    log = files(tmp_path, 1)["log"]
    p = test_storage.payload(1, 10, 5000)
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
    starts = await write(tmp_path, 10, index_interval_bytes=interval)
    flip(tmp_path, starts[5] + RECORD_HEADER_SIZE + 100, 0x08)
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
    starts = await write(tmp_path, 10, index_interval_bytes=interval)
    data = bytearray(log_file(tmp_path).read_bytes())
    data[starts[5] : starts[5] + 8] = b"\xff" * 8
    data[starts[0] + 3] ^= 1  # and entry 0's header
    log_file(tmp_path).write_bytes(data)
    async with open_store(tmp_path, index_interval_bytes=interval) as store:
        assert store.last_entry_id(1) == 9
        for bad in (0, 5):
            with pytest.raises(CorruptEntry):
                store.read_entries(1, bad, bad)
        assert [i for i, _ in store.read_entries(1, 1, 9)] == [1, 2, 3, 4]
        assert store.read_entries(1, 6, 9) == [(i, payload(i)) for i in range(6, 10)]


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
            assert store.read_entries(1, i, i) == [(i, test_storage.payload(1, i))]


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


async def test_data_dir_is_locked(tmp_path: Path) -> None:
    async with open_store(tmp_path):
        with pytest.raises(StorageError, match="in use"):
            await SegmentStore(tmp_path).run()
    async with open_store(tmp_path):  # released on exit
        pass
