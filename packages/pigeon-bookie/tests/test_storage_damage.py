"""Damaged segment files: what a starting store says about them, and repairs.

Damage is made the way an operator or a failing disk makes it: the data file of a
stopped store is truncated, or a bit in it is flipped; then the store starts again.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from pigeon.bookie._segment import RECORD_HEADER_SIZE
from pigeon.bookie._storage import SegmentStore
from pigeon.core.errors import CorruptEntry, EntryNotFound, InvalidEntryId

LOGGER = "pigeon.bookie._storage"


def payload(entry_id: int, size: int = 500) -> bytes:
    return random.Random(entry_id).randbytes(size)


@asynccontextmanager
async def open_store(path: Path, **kw: Any) -> AsyncIterator[SegmentStore]:
    dense_window = kw.pop("dense_window", None)
    store = SegmentStore(path, fsync="never", **kw)
    if dense_window is not None:
        store._dense_window = dense_window
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        yield store
        nursery.cancel_scope.cancel()


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
