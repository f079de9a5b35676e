"""The write path of the segment store (pigeon.bookie._storage_writes): single and
batched adds, recovery adds, write errors; payloads reach the data file as the buffers
they arrived in."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path
from typing import Any

import pytest
from test_storage import add_fails_read_only, check_all, files, fill, open_store, payload

import pigeon.bookie._storage_state as state_mod
from pigeon.bookie._segment import crc32c
from pigeon.bookie._storage_state import pwritev_all
from pigeon.core.errors import (
    InvalidArgument,
    InvalidEntryId,
)

#: payload sizes on either side of the size above which a view's checksum is taken in
#: place (64 KiB), empty included
SIZES = [0, 1, 700, 65_535, 65_536, 300_000]


def frame(sizes: list[int]) -> tuple[bytes, list[memoryview]]:
    """A received frame (one ``bytes`` object, as the frame decoder yields it) and the
    payloads in it, as memoryviews of that frame."""
    rng = random.Random(len(sizes))
    data = rng.randbytes(64 + sum(sizes))
    views, pos = [], 64
    for size in sizes:
        views.append(memoryview(data)[pos : pos + size])
        pos += size
    return data, views


@pytest.mark.parametrize("batched", [False, True])
async def test_payload_views_are_written_as_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batched: bool
) -> None:
    _frame, views = frame(SIZES)
    written: list[list[Any]] = []
    real = os.pwritev

    def spy(fd: int, bufs: list[Any], offset: int) -> int:
        written.append(list(bufs))
        return real(fd, bufs, offset)

    async with open_store(tmp_path / "views") as store:
        monkeypatch.setattr(os, "pwritev", spy)
        if batched:
            await store.add_entries(1, 0, views, lac=-1)
        else:
            for i, view in enumerate(views):
                await store.add_entry(1, i, view, lac=i - 1)
        monkeypatch.undo()
        assert [p for _, p in store.read_entries(1, 0, 99)] == [bytes(v) for v in views]
    bufs = [b for call in written for b in call]
    # every payload went down as the very view it came in; nothing else was written but
    # the 40-byte record headers: no joined or copied payload
    assert [b for b in bufs if b is not None and any(b is v for v in views)] == views
    others = [b for b in bufs if not any(b is v for v in views)]
    assert all(type(b) is bytes and len(b) == 40 for b in others)
    assert len(others) == len(views)

    # the file is byte for byte the one that the same entries as ``bytes`` make
    async with open_store(tmp_path / "bytes") as store:
        if batched:
            await store.add_entries(1, 0, [bytes(v) for v in views], lac=-1)
        else:
            for i, view in enumerate(views):
                await store.add_entry(1, i, bytes(view), lac=i - 1)
    for kind in ("log", "idx"):
        assert files(tmp_path / "views", 1)[kind].read_bytes() == (
            files(tmp_path / "bytes", 1)[kind].read_bytes()
        )


@pytest.mark.parametrize("size", [*SIZES, 1 << 20])
def test_checksum_of_a_view_is_that_of_its_bytes(size: int) -> None:
    _frame, [view] = frame([size])
    expected = crc32c(bytes(view))
    assert crc32c(view) == expected
    assert crc32c(bytearray(view)) == expected


def test_short_writes_and_more_buffers_than_iov_max_are_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pwritev_all writes at most IOV_MAX buffers a call and goes on after a short write."""
    monkeypatch.setattr(state_mod, "IOV_MAX", 3)
    _frame, views = frame([5, 0, 7, 11, 2, 9, 4])
    calls: list[int] = []
    real = os.pwritev

    def short(fd: int, bufs: list[Any], offset: int) -> int:
        assert len(bufs) <= 3
        calls.append(len(bufs))
        n = sum(len(b) for b in bufs)
        head = b"".join(bufs)[: max(1, n // 2)]  # half of what was asked, at most
        return real(fd, [head], offset)

    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        monkeypatch.setattr(os, "pwritev", short)
        pwritev_all(fd, list(views), 10, sum(len(v) for v in views))
    finally:
        os.close(fd)
    assert path.read_bytes()[10:] == b"".join(views)
    assert len(calls) > 3


async def test_accepts_buffers(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        raw = b"0123456789"
        await store.add_entry(1, 0, bytearray(raw))
        await store.add_entry(1, 1, memoryview(raw)[2:5])
        await store.add_entry(1, 2, memoryview(raw))
        assert [p for _, p in store.read_entries(1, 0, 2)] == [raw, b"234", raw]
        with pytest.raises(InvalidArgument):
            await store.add_entry(1, 3, memoryview(raw)[::2])
        with pytest.raises(InvalidArgument):
            await store.add_entry(1, 3, "text")  # type: ignore[arg-type]
        assert store.last_entry_id(1) == 2


async def test_entry_ids_must_increase(tmp_path: Path) -> None:
    """Ids may skip (striping, a replacement bookie) but never go back or repeat."""
    async with open_store(tmp_path) as store:
        await store.add_entry(1, 0, b"a")
        with pytest.raises(InvalidEntryId):
            await store.add_entry(1, 0, b"a")  # duplicate
        await store.add_entry(1, 1, b"b")
        with pytest.raises(InvalidEntryId):
            await store.add_entry(1, 0, b"z")  # below the last
        with pytest.raises(InvalidEntryId):
            await store.add_entry(1, -1, b"b")
        with pytest.raises(InvalidArgument):
            await store.add_entry(-5, 0, b"b")
        await store.add_entry(1, 3, b"d")  # a gap: entry 2 is not stored here
        with pytest.raises(InvalidEntryId):
            await store.add_entry(1, 2, b"c")  # a skipped id cannot be filled in later
        assert [p for _, p in store.read_entries(1, 0, 9)] == [b"a", b"b", b"d"]
        assert store.last_entry_id(1) == 3


async def test_batched_adds(tmp_path: Path) -> None:
    async with open_store(tmp_path, index_interval_bytes=500) as store:
        await store.add_entries(4, 0, [payload(4, i) for i in range(1500)], lac=3)
        await store.add_entries(4, 1500, [])
        with pytest.raises(InvalidEntryId):
            await store.add_entries(4, 1499, [b"x"])
        await store.add_entries(4, 1500, [payload(4, 1500)])
        check_all(store, 4, 1501)
        assert store.read_lac(4) == 3
    async with open_store(tmp_path, index_interval_bytes=500) as store:
        check_all(store, 4, 1501)


async def test_recovery_adds(tmp_path: Path) -> None:
    async with open_store(tmp_path) as store:
        await fill(store, 1, 3)
        await store.fence(1)
        # BookKeeper's recovery adds pass the fence and are idempotent for equal bytes.
        await store.add_entry(1, 2, payload(1, 2), recovery=True)
        with pytest.raises(InvalidEntryId):
            await store.add_entry(1, 2, b"other bytes", recovery=True)
        await store.add_entry(1, 3, payload(1, 3), recovery=True)
        check_all(store, 1, 4)


async def test_write_error_turns_the_bookie_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.pwritev

    def full(fd: int, bufs: list[bytes], offset: int) -> int:
        real(fd, [bytes(b) for b in bufs][:1], offset)  # a partial record lands
        raise OSError(errno.ENOSPC, "No space left on device")

    async with open_store(tmp_path) as store:
        await fill(store, 1, 3)

        monkeypatch.setattr(os, "pwritev", full)
        await add_fails_read_only(store, 1, 3)
        monkeypatch.undo()
        await add_fails_read_only(store, 1, 3)
        check_all(store, 1, 3)  # reads go on
        assert store.segment_info(1).size_bytes == files(tmp_path, 1)["log"].stat().st_size
    async with open_store(tmp_path) as store:  # a restart clears the read-only state
        await fill(store, 1, 1, start=3)
        check_all(store, 1, 4)
