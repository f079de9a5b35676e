"""Entry ids that skip: striped ensembles and replacement bookies store only some ids."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_storage import open_store

from pigeon.bookie._segment import (
    FILE_HEADER_SIZE,
    RECORD_HEADER_SIZE,
)
from pigeon.bookie._storage import SegmentStore
from pigeon.core.errors import CorruptEntry, EntryNotFound, InvalidEntryId, SegmentNotFound

SEG = 7


def payload(entry_id: int, size: int | None = None) -> bytes:
    rng = random.Random(entry_id * 7919)
    return rng.randbytes(rng.randrange(1, 2000) if size is None else size)


def striped(n: int, ensemble: int = 3, quorum: int = 2, bookie: int = 1) -> list[int]:
    """The ids bookie ``bookie`` stores of entries 0..n-1: entry i goes to the
    ``quorum`` bookies starting at i mod ``ensemble``."""
    return [i for i in range(n) if (bookie - i) % ensemble < quorum]


def log_file(path: Path, segment_id: int = SEG) -> Path:
    return path / "segments" / f"{segment_id:016x}.log"


def ids_of(entries: list[tuple[int, bytes]]) -> list[int]:
    return [i for i, _ in entries]


def check_reads(store: SegmentStore, stored: list[int], bad: frozenset[int] = frozenset()) -> None:
    """Every single-entry and every range read agrees with ``stored``."""
    present = set(stored) - bad
    last = stored[-1]
    for i in range(last + 1):
        if i in bad:
            with pytest.raises(CorruptEntry):
                store.read_entries(SEG, i, i)
        elif i in present:
            assert store.read_entries(SEG, i, i) == [(i, payload(i))]
        else:
            with pytest.raises(EntryNotFound):
                store.read_entries(SEG, i, i)
    for first in sorted(present):
        got = store.read_entries(SEG, first, last + 10)
        want = [i for i in stored if i >= first]
        for j, i in enumerate(want):  # stops before a damaged entry, never skips one
            if i in bad:
                want = want[:j]
                break
        assert ids_of(got) == want
        assert all(p == payload(i) for i, p in got)
    with pytest.raises(EntryNotFound):
        store.read_entries(SEG, last + 1, last + 5)


# ------------------------------------------------------------------ store


async def test_striped_adds_and_reads(tmp_path: Path) -> None:
    stored = striped(60)
    async with open_store(tmp_path, index_interval_bytes=3000) as store:
        for i in stored:
            await store.add_entry(SEG, i, payload(i), lac=max(i - 2, -1))
        assert store.last_entry_id(SEG) == stored[-1]
        assert store.read_lac(SEG) == stored[-1] - 2
        check_reads(store, stored)
        got = await store.read_entries_async(SEG, 0, 100)
        assert ids_of(got) == stored
        # a missing first entry is EntryNotFound; ids absent inside a range are skipped
        assert 2 not in stored
        with pytest.raises(EntryNotFound):
            await store.read_entries_async(SEG, 2, 10)
        assert ids_of(store.read_entries(SEG, 1, 7)) == [1, 3, 4, 6, 7]
        with pytest.raises(InvalidEntryId):
            await store.add_entry(SEG, stored[-1], payload(stored[-1]))
        with pytest.raises(InvalidEntryId):  # a skipped id below the last one
            await store.add_entry(SEG, 2, payload(2))
    async with open_store(tmp_path, index_interval_bytes=3000) as store:
        assert store.last_entry_id(SEG) == stored[-1]
        check_reads(store, stored)
    # after a restart with a tiny dense window, reads go through the sparse index
    async with open_store(tmp_path, index_interval_bytes=3000, dense_window=2) as store:
        assert len(store._segments[SEG].starts) <= 4
        check_reads(store, stored)


async def test_replacement_bookie_starts_mid_segment(tmp_path: Path) -> None:
    start = 1_000_000
    async with open_store(tmp_path) as store:
        await store.add_entry(SEG, start, payload(start), lac=start - 1)
        await store.add_entries(SEG, start + 1, [payload(i) for i in range(start + 1, start + 5)])
        seg = store._segments[SEG]
        assert seg.base == start and len(seg.starts) == 5  # no position per skipped id
        assert store.last_entry_id(SEG) == start + 4
        assert store.read_lac(SEG) == start - 1
        with pytest.raises(EntryNotFound):
            store.read_entries(SEG, 0, 10)
        with pytest.raises(EntryNotFound):
            store.read_entries(SEG, start - 1, start + 3)
        assert ids_of(store.read_entries(SEG, start, start + 100)) == list(range(start, start + 5))
        # a second ensemble change far ahead: the dense positions start afresh
        far = start + 10_000_000
        await store.add_entry(SEG, far, payload(far))
        assert len(store._segments[SEG].starts) == 1
        got = store.read_entries(SEG, start + 2, far)
        assert ids_of(got) == [start + 2, start + 3, start + 4, far]
    async with open_store(tmp_path) as store:
        assert store.last_entry_id(SEG) == far
        assert len(store._segments[SEG].starts) <= 2 * store._dense_window
        got = await store.read_entries_async(SEG, start, far)
        assert got == [(i, payload(i)) for i in [*range(start, start + 5), far]]
        with pytest.raises(EntryNotFound):
            store.read_entries(SEG, far - 1, far - 1)


async def test_fence_and_recovery_adds_with_gaps(tmp_path: Path) -> None:
    stored = striped(20)
    async with open_store(tmp_path) as store:
        for i in stored:
            await store.add_entry(SEG, i, payload(i))
        assert await store.fence(SEG) == stored[-1]
        await store.add_entry(SEG, stored[-3], payload(stored[-3]), recovery=True)
        with pytest.raises(InvalidEntryId):  # skipped: cannot be filled in below the last
            await store.add_entry(SEG, 2, payload(2), recovery=True)
        await store.add_entry(SEG, stored[-1] + 2, payload(stored[-1] + 2), recovery=True)
        stored.append(stored[-1] + 2)
        check_reads(store, stored)
    async with open_store(tmp_path) as store:
        assert store.segment_info(SEG).fenced
        check_reads(store, stored)


async def test_torn_tail_with_gaps(tmp_path: Path) -> None:
    stored = striped(36, ensemble=5, quorum=2)  # ... 30 31 35
    async with open_store(tmp_path, index_interval_bytes=1) as store:
        for i in stored:
            await store.add_entry(SEG, i, payload(i))
        last_start = store._segments[SEG].starts[-1]
    log = log_file(tmp_path)
    # cut inside the last record: that record (a checkpoint, the interval is 1 byte)
    # is torn; the last entry stored before it is two ids back, not one
    os.truncate(log, last_start + RECORD_HEADER_SIZE + 1)
    async with open_store(tmp_path, index_interval_bytes=1) as store:
        assert store.last_entry_id(SEG) == stored[-2]
        assert stored[-1] - stored[-2] > 1
        check_reads(store, stored[:-1])
        await store.add_entry(SEG, stored[-1], payload(stored[-1]))  # written again
        check_reads(store, stored)
    async with open_store(tmp_path, index_interval_bytes=1) as store:
        check_reads(store, stored)


@pytest.mark.parametrize("interval", [64 << 10, 100])
async def test_damaged_header_with_gaps_is_corrupt_not_missing(
    tmp_path: Path, interval: int
) -> None:
    """Ids between the records around a damaged header might have been there: they are
    reported CorruptEntry (read them elsewhere), never EntryNotFound."""
    stored = striped(30)  # 0 1 3 4 6 7 9 10 ...
    async with open_store(tmp_path, index_interval_bytes=interval) as store:
        for i in stored:
            await store.add_entry(SEG, i, payload(i, 300))
        seg = store._segments[SEG]
        pos = {i: seg.starts[i - seg.base] for i in stored}
    log = log_file(tmp_path)
    data = bytearray(log.read_bytes())
    data[pos[9] + 5] ^= 0x40  # entry 9's header: 8 (skipped), 9 lost; 10 follows
    log.write_bytes(data)
    async with open_store(tmp_path, index_interval_bytes=interval) as store:
        assert store.last_entry_id(SEG) == stored[-1]
        for bad in (8, 9):
            with pytest.raises(CorruptEntry):
                store.read_entries(SEG, bad, bad)
        with pytest.raises(EntryNotFound):
            store.read_entries(SEG, 5, 5)  # skipped, far from the damage
        assert ids_of(store.read_entries(SEG, 0, 100)) == [0, 1, 3, 4, 6, 7]
        assert ids_of(store.read_entries(SEG, 10, 100)) == [i for i in stored if i >= 10]


async def test_first_add_may_be_any_id_and_empty_file_is_removed(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await store.add_entry(SEG, 500, b"x")
    log = log_file(tmp_path)
    os.truncate(log, FILE_HEADER_SIZE + 10)  # its only record torn: never acknowledged
    async with open_store(tmp_path) as store:
        assert store.segments() == []
        with pytest.raises(SegmentNotFound):
            store.read_entries(SEG, 500, 500)


# ------------------------------------------------------------------ format level


# ------------------------------------------------------------------ fuzz

damage = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
    st.tuples(st.just("zeros"), st.floats(0, 1), st.integers(1, 600)),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
)


def _damage(path: Path, ops: list[tuple[Any, ...]]) -> None:
    log = log_file(path)
    data = bytearray(log.read_bytes())
    for op in ops:
        at = int(len(data) * op[1])
        if op[0] == "flip" and at < len(data):
            data[at] ^= op[2]
        elif op[0] == "zeros":
            data[at : at + op[2]] = bytes(len(data[at : at + op[2]]))
        elif op[0] == "truncate":
            del data[max(at, FILE_HEADER_SIZE) :]
    log.write_bytes(data)


@settings(
    max_examples=int(os.environ.get("PIGEON_STORAGE_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=30),
    first=st.integers(0, 100),
    interval=st.sampled_from([1, 500, 1 << 20]),
    dense_window=st.sampled_from([2, 1 << 16]),
    ops=st.lists(damage, min_size=0, max_size=3),
)
def test_gaps_and_damage_never_return_wrong_data(
    steps: list[int], first: int, interval: int, dense_window: int, ops: list[Any]
) -> None:
    ids = []
    i = first
    for s in steps:
        ids.append(i)
        i += s
    opts = {"index_interval_bytes": interval, "dense_window": dense_window, "fsync": "never"}

    async def write(store: SegmentStore) -> None:
        for i in ids:
            await store.add_entry(SEG, i, payload(i), lac=i - 1)

    async def check(store: SegmentStore) -> set[int]:
        if SEG not in store.segments():
            return set()
        last = store.last_entry_id(SEG)
        ok = set()
        for i in range(last + 2):
            try:
                got = store.read_entries(SEG, i, i)
            except (CorruptEntry, EntryNotFound):
                continue
            assert got == [(i, payload(i))]  # never wrong data, never an unwritten id
            ok.add(i)
        for a in sorted(ok):
            got = store.read_entries(SEG, a, last + 3)
            assert all(p == payload(i) for i, p in got)
            assert set(ids_of(got)) <= ok and ids_of(got) == sorted(ids_of(got))
        return ok

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)

        async def run(fn: Any) -> Any:
            async with open_store(path, **opts) as store:
                return await fn(store)

        trio.run(run, write)
        clean = trio.run(run, check)
        assert clean == set(ids)
        _damage(path, ops)
        before = trio.run(run, check)
        after = trio.run(run, check)  # recovery never drops what was readable
        assert before <= after
