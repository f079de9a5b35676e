"""Offloader contract suite: what every tiered-storage offloader must do.

Subclass :class:`OffloaderContract` and provide an ``offloader`` fixture (a fresh,
empty store per test)::

    class TestFilesystem(OffloaderContract):
        @pytest.fixture
        def offloader(self, tmp_path):
            return FileSystemOffloader(tmp_path)

The suite checks exact round trips over ranges and ``max_bytes`` cuts, that an upload
that failed half-way is never read as a segment, that offloading a segment again
overwrites it, that deletes are idempotent (and take a key alone), that non-dense entry
ids are refused with :class:`~pigeon.core.errors.OffloadError`, and (for a
:class:`~pigeon.core.offload.BlobOffloader`) that catching up reads by ranges.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pigeon.core.errors import CorruptEntry, EntryNotFound, OffloadError
from pigeon.core.offload import BlobOffloader, Offloader

__all__ = ["OffloaderContract"]


def segment_entries(count: int, *, seed: int = 3, size: int = 700) -> list[bytes]:
    rnd = random.Random(seed)
    return [rnd.randbytes(rnd.randint(1, size)) for _ in range(count)]


async def batches(
    entries: list[bytes], per_batch: int = 17, *, fail_at: int = -1
) -> AsyncIterator[list[tuple[int, bytes]]]:
    for start in range(0, len(entries), per_batch):
        if 0 <= fail_at <= start:
            raise OffloadError("the bookies went away")
        yield [(start + i, e) for i, e in enumerate(entries[start : start + per_batch])]


async def read_all(
    offloader: Offloader, location: dict[str, Any], count: int, max_bytes: int = 1 << 20
) -> list[bytes]:
    out: list[bytes] = []
    while len(out) < count:
        got = await offloader.read(location, len(out), count - 1, max_bytes=max_bytes)
        assert got, "a read returns one entry at least"
        assert [eid for eid, _ in got] == list(range(len(out), len(out) + len(got)))
        out.extend(bytes(d) for _, d in got)
    return out


class OffloaderContract:
    """The acceptance suite of an offloader (see module doc)."""

    @pytest.fixture
    def offloader(self) -> Offloader:
        raise NotImplementedError("provide an 'offloader' fixture")

    async def test_round_trip_is_exact(self, offloader: Offloader) -> None:
        entries = segment_entries(200)
        location = await offloader.offload("t/1", 1, batches(entries))
        assert location["entries"] == 200 and location["size"] == sum(map(len, entries))
        assert await read_all(offloader, location, 200) == entries
        assert await read_all(offloader, location, 200, max_bytes=1) == entries
        got = await offloader.read(location, 50, 59, max_bytes=1 << 20)
        assert [bytes(d) for _, d in got] == entries[50:60]

    async def test_max_bytes_cuts_at_whole_entries(self, offloader: Offloader) -> None:
        entries = [b"a" * 100] * 10
        location = await offloader.offload("t/2", 2, batches(entries))
        got = await offloader.read(location, 0, 9, max_bytes=250)
        assert [bytes(d) for _, d in got] == entries[:2]
        got = await offloader.read(location, 9, 9, max_bytes=1)
        assert [bytes(d) for _, d in got] == entries[9:]
        with pytest.raises(EntryNotFound):
            await offloader.read(location, 10, 12, max_bytes=1000)

    async def test_failed_upload_is_never_read(self, offloader: Offloader) -> None:
        entries = segment_entries(100)
        with pytest.raises(OffloadError):
            await offloader.offload("t/3", 3, batches(entries, fail_at=50))
        location = {"key": "t/3", "entries": 100}
        with pytest.raises((OffloadError, CorruptEntry)):
            await offloader.read(location, 0, 10, max_bytes=1 << 20)
        # retried later: whole
        location = await offloader.offload("t/3", 3, batches(entries))
        assert await read_all(offloader, location, 100) == entries

    async def test_offloading_again_overwrites(self, offloader: Offloader) -> None:
        await offloader.offload("t/4", 4, batches(segment_entries(30, seed=1)))
        entries = segment_entries(40, seed=2)
        location = await offloader.offload("t/4", 4, batches(entries))
        assert await read_all(offloader, location, 40) == entries

    async def test_delete_is_idempotent(self, offloader: Offloader) -> None:
        location = await offloader.offload("t/5", 5, batches(segment_entries(20)))
        await offloader.delete(location)
        await offloader.delete(location)
        with pytest.raises((OffloadError, CorruptEntry)):
            await offloader.read(location, 0, 1, max_bytes=1 << 20)

    async def test_delete_by_key_alone(self, offloader: Offloader) -> None:
        # the key of an upload the broker did not record (cut short or still running
        # when its segment was removed): whatever is stored under it goes
        location = await offloader.offload("t/8", 8, batches(segment_entries(20)))
        await offloader.delete({"driver": offloader.name, "key": "t/8"})
        with pytest.raises((OffloadError, CorruptEntry)):
            await offloader.read(location, 0, 1, max_bytes=1 << 20)
        await offloader.delete({"driver": offloader.name, "key": "t/never-written"})

    async def test_objects_are_listed_a_page_at_a_time(self, offloader: Offloader) -> None:
        # what the broker's sweeper walks: every object under a prefix, in path order,
        # ``limit`` at a time from after the last path seen, with its modification time
        if not isinstance(offloader, BlobOffloader):
            pytest.skip("listing is BlobOffloader's")
        for seg in (1, 2, 3):
            await offloader.offload(f"a/t/{seg}", seg, batches(segment_entries(3)))
        await offloader.offload("b/t/1", 1, batches(segment_entries(3)))
        pages: list[list[str]] = []
        after = ""
        for _ in range(10):
            page = await offloader.list_objects("a/", after=after, limit=4)
            if not page:
                break
            pages.append([o.path for o in page])
            after = page[-1].path
        assert pages == [
            ["a/t/1/data", "a/t/1/index", "a/t/2/data", "a/t/2/index"],
            ["a/t/3/data", "a/t/3/index"],
        ]
        (data,) = [o for o in await offloader.list_objects("b/") if o.path == "b/t/1/data"]
        assert abs(data.modified_ms - time.time() * 1000) < 600_000
        await offloader.delete_objects(["a/t/2/data", "a/t/2/index"])
        assert "a/t/2/data" not in [o.path for o in await offloader.list_objects("a/")]

    async def test_entries_must_be_dense(self, offloader: Offloader) -> None:
        async def gap() -> AsyncIterator[list[tuple[int, bytes]]]:
            yield [(0, b"a"), (2, b"c")]

        with pytest.raises(OffloadError):
            await offloader.offload("t/6", 6, gap())

    async def test_catch_up_reads_by_ranges(self, offloader: Offloader) -> None:
        if not isinstance(offloader, BlobOffloader):
            pytest.skip("range accounting is BlobOffloader's")
        entries = segment_entries(1000, size=200)
        location = await offloader.offload("t/7", 7, batches(entries, per_batch=100))
        offloader.read_ahead_bytes = 20_000
        before = offloader.range_reads
        out: list[bytes] = []
        for i in range(1000):  # one entry per read, as a slow consumer asks
            out.extend(bytes(d) for _, d in await offloader.read(location, i, i, max_bytes=1))
        assert out == entries
        # ~100 KB of entries in 20 KB read-ahead ranges: a handful of requests, not 1000
        assert offloader.range_reads - before <= 2 + sum(map(len, entries)) // 10_000

    async def test_a_damaged_entry_ends_a_read_before_it(
        self, offloader: Offloader, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # like a bookie's read: the intact entries before a damaged one are returned
        # (a reader gets them, then CorruptEntry at the damaged one alone), so that
        # skipping the damage never skips intact entries
        if not isinstance(offloader, BlobOffloader):
            pytest.skip("damage is injected through BlobOffloader's range reads")
        entries = [bytes([i]) * 100 for i in range(10)]
        location = await offloader.offload("t/8", 8, batches(entries))
        real = offloader._read_range

        async def rotten(path: str, start: int, end: int) -> bytes:
            data = bytearray(await real(path, start, end))
            if start <= 450 < end:
                data[450 - start] ^= 0xFF  # a bit of entry 4 rots in the store
            return bytes(data)

        monkeypatch.setattr(offloader, "_read_range", rotten)
        got = await offloader.read(location, 1, 9, max_bytes=1 << 20)
        assert [bytes(d) for _, d in got] == entries[1:4]
        with pytest.raises(CorruptEntry):
            await offloader.read(location, 4, 9, max_bytes=1 << 20)
        got = await offloader.read(location, 5, 9, max_bytes=1 << 20)
        assert [bytes(d) for _, d in got] == entries[5:]
